"""The command line's loss: cross-entropy of the model's logits against the batch's targets,
integer class ids (a float target, a regression's, is one error saying so, not PyTorch's
"expected target dtype to be Long" raised inside autobatch).

A model may return its logits as a tensor, as an output object (Hugging Face's ``.logits``),
as a mapping with a ``"logits"`` entry (a model of one's own that returns a dict, as many
multi-head and Hugging Face-style models do), or as a tuple or list with the logits first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.nn import functional as F

__all__ = ["cross_entropy_loss", "TargetOutOfRange", "own_loss_hint"]

#: The names a user gives a loss of their own under (``loss=mypkg.my_loss``, ``+loss._target_=...``,
#: ``train.criterion: ...`` in a YAML): the command line has no such key.
_LOSS_NAMES = frozenset({"loss", "losses", "loss_fn", "loss_func", "loss_function", "criterion", "objective_fn"})
#: The nodes whose keys are a constructor's arguments (a model's own ``loss_fn`` is checked there).
_FREE_NODES = frozenset({"model", "optimizer", "scheduler"})


def cross_entropy_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of ``model(inputs)`` against ``targets``; logits ``[..., classes]`` are
    flattened, so it serves classifiers ``[B, C]`` and language models ``[B, T, V]`` alike.
    A model that returns an output object (Hugging Face's ``.logits``), a dict with ``"logits"``
    or a tuple (logits first) is read the same way, so ``model._target_=transformers.LlamaForCausalLM``
    trains as is."""
    inputs, targets = batch
    logits = _logits(model(inputs))
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(
            f"the CLI's loss is cross-entropy over class ids, but the targets are {str(targets.dtype).replace('torch.', '')} "
            f"(shape {list(targets.shape[1:])} a sample): give integer class ids in [0, {logits.shape[-1]}) as the "
            "targets (a regression or another loss needs the library: autobatch.Runner(model, optimizer, loss_fn, ...))"
        )
    try:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
    except IndexError as exc:  # torch's "Target 5 is out of bounds." (on the CPU; CUDA asserts instead)
        message = _out_of_range(logits, targets)
        if message is None:  # no target out of range: not this mistake, torch's own error stands
            raise
        raise TargetOutOfRange(message) from exc


def own_loss_hint(key: str) -> str:
    """What to do, for a key ``key`` (``loss``, ``loss._target_``, ``train.loss``) that names a loss
    of the user's own, which the command line has no setting for; "" for any other key. Before,
    ``+loss._target_=mypkg.my_loss`` was told "the top level has no key 'loss'; + adds keys only to a
    _target_", ``+loss=mypkg.my_loss`` to give ``--config-dir`` for a group ``loss``, and a YAML's
    ``loss:`` was shown the config's keys: none said that the loss is fixed or where another goes."""
    parts = key.lstrip("+~").split("=", 1)[0].split(".")
    named = parts[0] in _LOSS_NAMES or (len(parts) > 1 and parts[0] not in _FREE_NODES and parts[1] in _LOSS_NAMES)
    if not named:
        return ""
    return ("the command line has no loss setting: its loss is cross-entropy of the model's logits against integer "
            "class ids (a model that returns logits, an object with .logits, a dict with 'logits' or a tuple with "
            "the logits first trains as is); a loss of your own trains with autobatch.Runner(model, optimizer, "
            "loss_fn, ...) in Python (docs/runner.md)")


class TargetOutOfRange(ValueError):
    """A target class id the model's logits have no class for: the data's classes and the
    model's outputs disagree (a config error, not the batch size's; autobatch's own, so the
    probe adds no note about the size it was found at)."""


def _out_of_range(logits: torch.Tensor, targets: torch.Tensor) -> str | None:
    """Which target is out of range and what to set. Before, torch's "Target 5 is out of bounds"
    came with the probe's note that an index out of range at a large batch is a dataset smaller
    than the batch: a model of one's own with 5 outputs against the synthetic 10 classes."""
    classes = logits.shape[-1]
    flat = targets.reshape(-1)
    bad = flat[((flat < 0) | (flat >= classes)) & (flat != -100)]  # -100: cross-entropy's ignore_index
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
        return output[0]
    keys = f" (its keys: {', '.join(map(str, list(output)[:6]))})" if isinstance(output, Mapping) else ""
    raise TypeError(
        f"the model returned {type(output).__name__}, not logits{keys}: the CLI's loss needs a tensor, an object "
        "with .logits (Hugging Face), a dict with 'logits' or a tuple whose first item is the logits; wrap the model "
        "so forward returns logits"
    )
