"""The command line's loss: the ``loss`` group's criterion, ``criterion(output, target) -> scalar``,
applied to the model's output and the batch's target, in the probe's ``TrainStep`` and the
training ``Runner`` alike (:func:`build_loss`).

``loss=cross_entropy`` (the default; ``torch.nn.CrossEntropyLoss``) is cross-entropy of the
model's logits against integer class ids: logits ``[..., classes]`` are flattened (classifiers
``[B, C]`` and language models ``[B, T, V]`` alike), a float target (a regression's) is one error
saying so, not PyTorch's "expected target dtype to be Long" raised inside autobatch, and a class
id the logits have no class for names ``data.num_classes``. ``loss=mse`` (``torch.nn.MSELoss``)
and any ``loss._target_`` (a ``torch.nn`` loss module with its arguments, ``+loss.label_smoothing=0.1``;
a function with ``+loss._partial_=true``, ``torch.nn.functional.smooth_l1_loss``) get the output
as it is, cast to float32 where autocast made it lower (as cross-entropy's logits are).

A model may return its output as a tensor, as an output object (Hugging Face's ``.logits``),
as a mapping with a ``"logits"`` entry (a model of one's own that returns a dict, as many
multi-head and Hugging Face-style models do), or as a tuple or list with the logits first.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any, Callable

import torch
from omegaconf import DictConfig, OmegaConf
from torch.nn import functional as F

__all__ = ["cross_entropy_loss", "criterion_loss", "build_loss", "check_loss", "loss_text", "TargetOutOfRange",
           "TargetShapeMismatch", "own_loss_hint"]

#: The names a user gives a loss of their own under (``train.loss=mypkg.my_loss``, ``criterion: ...``
#: in a YAML): the command line's key is ``loss``.
_LOSS_NAMES = frozenset({"loss", "losses", "loss_fn", "loss_func", "loss_function", "criterion", "objective_fn"})
#: The nodes whose keys are a constructor's arguments (a model's own ``loss_fn`` is checked there).
_FREE_NODES = frozenset({"model", "optimizer", "scheduler", "loss"})
#: The criteria over class ids: their targets are checked and their logits flattened.
_CLASS_IDS = (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)
_CLASS_ID_FUNCTIONS = (F.cross_entropy, F.nll_loss)
#: torch's criteria that compare the output with a float target of its shape, element by element.
_ELEMENTWISE = (torch.nn.MSELoss, torch.nn.L1Loss, torch.nn.SmoothL1Loss, torch.nn.HuberLoss, torch.nn.BCEWithLogitsLoss,
                torch.nn.BCELoss)
_ELEMENTWISE_FUNCTIONS = (F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.binary_cross_entropy_with_logits,
                          F.binary_cross_entropy)
#: The loss a config without a ``loss`` node trains with (a config of one's own from before the group).
DEFAULT_LOSS = {"_target_": "torch.nn.CrossEntropyLoss"}
#: Weight arguments torch takes as tensors, which a YAML gives as lists (``+loss.weight=[1.0,2.0]``).
_TENSOR_ARGUMENTS = ("weight", "pos_weight")


def criterion_loss(criterion: Callable[..., torch.Tensor], model: torch.nn.Module,
                   batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``criterion(output, targets)`` for ``model(inputs)``'s output (its logits: a tensor, an
    output object's ``.logits``, a dict's ``"logits"`` or a tuple's first item). A criterion over
    class ids (cross-entropy, NLL) gets the logits flattened to ``[N, classes]`` and the targets to
    ``[N]``, checked to be integer class ids in range (int32 and other integer ids made int64); a
    float16/bfloat16 output is cast to float32."""
    inputs, targets = batch
    logits = _logits(model(inputs))
    if not _over_class_ids(criterion):
        if logits.is_floating_point() and logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        _check_float_targets(criterion, logits, targets)
        return criterion(logits, targets)
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(
            f"the CLI's loss is cross-entropy over class ids, but the targets are {str(targets.dtype).replace('torch.', '')} "
            f"(shape {list(targets.shape[1:])} a sample): give integer class ids in [0, {logits.shape[-1]}) as the "
            "targets, or another loss than loss=cross_entropy: loss=mse for a regression, or "
            "loss._target_=<a criterion(output, target)> (docs/cli.md, 'Losses')"
        )
    if targets.dtype != torch.long:  # int32 (numpy's on Windows, a .int() label): torch's "expected target dtype
        targets = targets.long()      # to be Long or Byte, but got Int"; the same class ids as int64
    if logits.shape[:-1].numel() != targets.numel():  # torch's "Expected input batch_size (8) to match target
        raise TargetShapeMismatch(_shape_mismatch(logits, targets))  # batch_size (128)", raised inside autobatch
    try:
        return criterion(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
    except IndexError as exc:  # torch's "Target 5 is out of bounds." (on the CPU; CUDA asserts instead)
        message = _out_of_range(logits, targets, getattr(criterion, "ignore_index", -100))
        if message is None:  # no target out of range: not this mistake, torch's own error stands
            raise
        raise TargetOutOfRange(message) from exc


_CROSS_ENTROPY = torch.nn.CrossEntropyLoss()


def cross_entropy_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``loss=cross_entropy``: cross-entropy of ``model(inputs)`` 's logits against ``targets``
    (:func:`criterion_loss` with ``torch.nn.CrossEntropyLoss()``); a model that returns an output
    object (Hugging Face's ``.logits``), a dict with ``"logits"`` or a tuple (logits first) is read
    the same way, so ``model._target_=transformers.LlamaForCausalLM`` trains as is."""
    return criterion_loss(_CROSS_ENTROPY, model, batch)


def _check_float_targets(criterion: Any, output: torch.Tensor, targets: torch.Tensor) -> None:
    """An element-wise criterion (``loss=mse``) given class ids, or a target of another shape than the
    output: one error naming both. Before, class ids failed inside torch on "Found dtype Long but
    expected Float", and a ``[B, 1]`` output against a ``[B]`` target broadcast to ``[B, B]`` with
    only torch's warning, training another loss."""
    func = criterion.func if isinstance(criterion, functools.partial) else criterion
    if not (isinstance(func, _ELEMENTWISE) or any(func is known for known in _ELEMENTWISE_FUNCTIONS)):
        return
    name = type(func).__name__ if isinstance(func, torch.nn.Module) else getattr(func, "__name__", "the loss")
    if not targets.is_floating_point():
        raise TypeError(
            f"the loss ({name}) compares the model's output with float targets of its shape, but the targets are "
            f"{str(targets.dtype).replace('torch.', '')} (class ids, as synthetic data's are): give a data.dataset "
            "whose targets are floats, or a loss over class ids (loss=cross_entropy)"
        )
    if output.shape != targets.shape:
        raise ValueError(
            f"the loss ({name}) compares the model's output, shape {list(output.shape)}, with the targets element "
            f"by element, but the targets' shape is {list(targets.shape)} (torch would broadcast them and train another "
            "loss): give the model as many outputs per sample as a target has values (or the targets the output's shape)"
        )


def _over_class_ids(criterion: Any) -> bool:
    func = criterion.func if isinstance(criterion, functools.partial) else criterion
    return isinstance(func, _CLASS_IDS) or any(func is known for known in _CLASS_ID_FUNCTIONS)


def loss_node(cfg: DictConfig) -> Any:
    """The config's ``loss`` node as plain data (:data:`DEFAULT_LOSS` where the config has none:
    one of one's own from before the ``loss`` group trains with cross-entropy, as it did)."""
    node = cfg.get("loss") if isinstance(cfg, DictConfig) else None
    if node is None:
        return dict(DEFAULT_LOSS)
    return OmegaConf.to_container(node, resolve=True, enum_to_str=True) if OmegaConf.is_config(node) else node


def loss_text(node: Any) -> str:
    """A loss node as the command line writes it: ``torch.nn.MSELoss``, with its arguments
    (``torch.nn.CrossEntropyLoss(label_smoothing=0.1)``)."""
    if not isinstance(node, dict):
        return str(node)
    arguments = ", ".join(f"{key}={value!r}" for key, value in node.items() if key != "_target_")
    return f"{node.get('_target_')}({arguments})" if arguments else str(node.get("_target_"))


def check_loss(cfg: DictConfig, check_target: Callable[[str, Any], Any]) -> None:
    """The ``loss`` node: its ``_target_`` importable and callable (``check_target``, the other
    groups' check), its keys the target's arguments, and a function that takes ``(output, target)``
    given ``_partial_: true`` (without it the function was called with its arguments alone, and
    failed on missing ``input`` and ``target``). Nothing for a config without a ``loss`` node."""
    from . import validation

    node = cfg.get("loss")
    if node is None:
        return
    if not isinstance(node, DictConfig):
        raise ValueError(f"loss={node!r} is not a loss node; choose loss=cross_entropy or loss=mse, or give "
                         "loss._target_=<a criterion(output, target) class or function> (docs/cli.md, 'Losses')")
    target = check_target("loss", node)
    validation.check_target_arguments("loss", node, target)
    if not isinstance(target, type) and node.get("_partial_") is not True and _takes_pair(target, node):
        raise ValueError(
            f"loss._target_={node._target_} is a function of (output, target), which the loss calls on every batch: "
            "give +loss._partial_=true so that it is not called when the loss is built"
        )


def _takes_pair(function: Any, node: DictConfig) -> bool:
    """Whether ``function`` has two or more required positional parameters the node does not give."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: construct's line names what it wants
        return False
    given = set(node.keys())
    required = [p for p in parameters if p.default is p.empty and p.name not in given
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) >= 2


def build_loss(cfg: DictConfig, device: torch.device) -> Callable[[torch.nn.Module, Any], torch.Tensor]:
    """The ``loss_fn(model, batch)`` the probe and the runner train with: :func:`cross_entropy_loss`
    for the default (the same object: the probe cache's keys stay), else :func:`criterion_loss`
    over the criterion the ``loss`` node builds (a module moved to ``device``: its class
    ``weight``), a ``functools.partial`` that the probe cache keys by the criterion's class,
    settings and code."""
    from .construct import construct

    node = loss_node(cfg)
    if node == DEFAULT_LOSS:
        return cross_entropy_loss
    tensors = {key: _as_tensor(key, node.pop(key)) for key in _TENSOR_ARGUMENTS if isinstance(node.get(key), list)}
    criterion = construct("loss", node, keep_partial=True, **tensors)
    if not callable(criterion):
        raise ValueError(f"loss._target_={node.get('_target_')!r} built a {type(criterion).__name__}, which cannot be "
                         "called; give a criterion(output, target) -> scalar: a torch.nn loss class, or a function "
                         "with +loss._partial_=true")
    if isinstance(criterion, torch.nn.Module):
        criterion = criterion.to(device)
    return functools.partial(criterion_loss, criterion)


def _as_tensor(key: str, value: list) -> torch.Tensor:
    """A list of numbers given to ``weight`` / ``pos_weight`` as the float tensor torch takes."""
    try:
        return torch.tensor(value, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"loss.{key}={value} is not a list of numbers ({exc}); give one number a class, e.g. "
                         f"+loss.{key}=[1.0,2.0,1.0]") from None


def own_loss_hint(key: str) -> str:
    """Where a loss of one's own goes, for a key ``key`` that names one elsewhere than the ``loss``
    group (``train.loss``, ``+criterion=...``, a YAML's ``loss_fn:``); "" for any other key."""
    parts = key.lstrip("+~").split("=", 1)[0].split(".")
    named = parts[0] in _LOSS_NAMES or (len(parts) > 1 and parts[0] not in _FREE_NODES and parts[1] in _LOSS_NAMES)
    if not named or parts[0] == "loss" and len(parts) > 1:
        return ""
    return ("the loss is the top-level loss group: loss=cross_entropy (the default) or loss=mse, or any "
            "criterion(output, target) by loss._target_ (a torch.nn loss class, its arguments with "
            "+loss.<name>=VALUE: loss._target_=torch.nn.CrossEntropyLoss +loss.label_smoothing=0.1; a function "
            "with +loss._partial_=true) (docs/cli.md, 'Losses')")


class TargetOutOfRange(ValueError):
    """A target class id the model's logits have no class for: the data's classes and the
    model's outputs disagree (a config error, not the batch size's; autobatch's own, so the
    probe adds no note about the size it was found at)."""


class TargetShapeMismatch(ValueError):
    """Logits and targets of shapes no flattening pairs up: a classifier over token inputs against the
    synthetic data's targets, one token id per position (a language model's). A config error, as
    :class:`TargetOutOfRange` is, so the probe adds no note about the size it was found at."""


def _shape_mismatch(logits: torch.Tensor, targets: torch.Tensor) -> str:
    """What to change when the logits' rows and the targets' class ids differ in number. Before, torch's
    "Expected input batch_size (8) to match target batch_size (128)" was raised at autobatch's train step."""
    rows = list(logits.shape[:-1])
    return (
        f"the model's logits have shape {list(logits.shape)} and the targets {list(targets.shape)}: the CLI's loss "
        f"reads the logits' last dimension as the classes and needs one target class id for each of the rest "
        f"(targets of shape {rows}). Synthetic targets are one class id a sample for model.inputs=tensor, and one "
        "token id a position for model.inputs=tokens ([batch, data.seq_len], a language model's): give a data.dataset "
        "whose targets have that shape (a sequence classifier's, one class id a sample), or a model that returns "
        "logits [batch, ..., classes] for each target"
    )


def _out_of_range(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> str | None:
    """Which target is out of range and what to set. Before, torch's "Target 5 is out of bounds"
    came with the probe's note that an index out of range at a large batch is a dataset smaller
    than the batch: a model of one's own with 5 outputs against the synthetic 10 classes."""
    classes = logits.shape[-1]
    flat = targets.reshape(-1)
    bad = flat[((flat < 0) | (flat >= classes)) & (flat != ignore_index)]  # -100 unless the criterion says
    if not bad.numel():
        return None
    shown = int(bad.max() if bool((bad >= classes).any()) else bad.min())
    return (
        f"a target is class id {shown}, but the model's logits have {classes} classes (their last dimension): the CLI's "
        f"loss needs class ids in [0, {classes}). Synthetic targets are drawn below data.num_classes (data.vocab_size "
        f"for token inputs), a data.dataset's are its own: set data.num_classes={classes}, or give the model as many "
        "outputs as the data has classes"
    )


def _logits(output: Any) -> torch.Tensor:
    """The logits tensor of a model's output: the tensor itself, ``output.logits``,
    ``output["logits"]`` or ``output[0]``."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, Mapping):  # a plain dict: before, "returned dict, not logits"
        logits = output.get("logits")
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        if output[0].dim() == 0:  # (loss, logits), as a Hugging Face model given labels returns: before,
            # "tuple index out of range" with the probe's note blaming a dataset smaller than the batch
            shapes = ", ".join(str(list(item.shape)) if isinstance(item, torch.Tensor) else type(item).__name__
                               for item in output[:4])
            raise TypeError(
                f"the model returned a {type(output).__name__} whose first item is a 0-dim tensor (items: {shapes}), "
                "not logits: the CLI's loss takes the first item of a tuple as the logits [batch, ..., classes]; "
                "return the logits first, or a dict with 'logits' (or an object with .logits)"
            )
        return output[0]
    keys = f" (its keys: {', '.join(map(str, list(output)[:6]))})" if isinstance(output, Mapping) else ""
    raise TypeError(
        f"the model returned {type(output).__name__}, not logits{keys}: the CLI's loss needs a tensor, an object "
        "with .logits (Hugging Face), a dict with 'logits' or a tuple whose first item is the logits; wrap the model "
        "so forward returns logits"
    )
