"""Argument checks shared by every public entry point: one ``TypeError``/``ValueError`` that
names the argument, what it got and what it accepts, raised before any work starts."""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .errors import FakeTensorLeakError
from .keywords import closest, keywords  # the earliest stage's, for the memory stage too; re-exported
from .memory.devices import device_available, torch_device  # here with the memory stage, whose resolve_device checks too

__all__ = ["positive_int", "count", "positive_number", "positive_shape", "integer", "flag", "module", "materialized", "optimizer", "function",
           "torch_device", "dtype", "grad_scaler", "scheduler", "no_closure", "loss", "record_fields", "choice",
           "keywords", "closest", "strict_json"]


def shown(value: Any, width: int = 60) -> str:
    """``repr(value)`` on one line, cut at ``width``: a model's or optimizer's repr spans many lines."""
    return " ".join(line.strip() for line in repr(value).splitlines())[:width]


def integer(value: Any) -> int | None:
    """``value`` as a Python ``int`` where it is an integer of any type (``int``, a NumPy or a
    one-element torch integer: whatever ``operator.index`` takes), else None. A bool is not
    taken (``True`` is no batch size), nor a float, even a whole one (``8.0`` may be a typo for
    a fraction, and an index must be exact)."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def positive_int(name: str, value: Any, *, allow_none: bool = False) -> int | None:
    """``value`` is an integer >= 1 of any integer type (:func:`integer`), or None where
    ``allow_none``; returns it as a Python ``int``, so that what is stored (a cache key, a
    checkpoint) holds plain types."""
    if value is None and allow_none:
        return None
    number = integer(value)
    if number is None or number <= 0:
        accepted = "a positive integer or None" if allow_none else "a positive integer"
        raise ValueError(f"{name} must be {accepted}, got {value!r}{int_hint(name, value)}")
    return number


def count(name: str, value: Any, *, low: int = 0, allow_none: bool = False, meaning: str = "") -> int | None:
    """``value`` is an integer >= ``low`` of any integer type (:func:`integer`: a count of steps,
    ``grow_after``, ``log_every``), or None where ``allow_none``; returns it as a Python ``int``.
    ``meaning`` says what a value means (``" (0: off)"``). The counts' own checks each worded
    it differently and none said what to pass for ``4.0`` or ``"4"``: :func:`int_hint` does."""
    if value is None and allow_none:
        return None
    number = integer(value)
    if number is None or number < low:
        accepted = f"an integer >= {low}" + (" or None" if allow_none else "")
        raise ValueError(f"{name} must be {accepted}{meaning}, got {shown(value)}{int_hint(name, value)}")
    return number


def int_hint(name: str, value: Any) -> str:
    """``"; pass an int, e.g. max_batch=64"`` where ``value`` is a whole positive number of another
    type (``64.0`` from a division or a config, a NumPy float, a float tensor, the string ``"64"``),
    else ``""``: the bare "got 64.0" left the reader to find what was wrong."""
    whole = None
    if isinstance(value, str):
        whole = int(value.strip()) if value.strip().isdigit() else None
    elif isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point() and not value.is_meta:
        value = value.item()
    if not isinstance(value, (bool, str)) and isinstance(value, numbers.Real) and integer(value) is None:
        whole = int(value) if math.isfinite(value) and float(value).is_integer() else None
    told = f" (not the string {value!r:.20})" if isinstance(value, str) else ""
    return f"; pass an int, e.g. {name}={whole}{told}" if whole is not None and whole > 0 else ""


def positive_shape(name: str, value: Any) -> tuple[int, ...]:
    """``value`` as a tuple of positive integers (a sample's shape; ``()`` for a scalar sample),
    or one ``ValueError`` naming ``name``: a size of 0 or below failed inside torch ("Trying to
    create tensor with negative dimension"), which the command line took for a failure at run time."""
    dims = [integer(dim) for dim in value] if isinstance(value, (list, tuple, torch.Size)) else None
    if dims is None or any(dim is None or dim <= 0 for dim in dims):
        wholes = [integer(dim) if integer(dim) is not None else int(float(dim)) if int_hint("", dim) else 0
                  for dim in value] if dims else []  # [3.0, 32, 32]: what to pass, [3, 32, 32]
        hint = f"; pass ints, e.g. {name}={wholes}" if wholes and min(wholes) > 0 else ""
        raise ValueError(f"{name} must be a list of positive integers (one per dimension of a sample, "
                         f"e.g. [3, 32, 32]), got {shown(value)}{hint}")
    return tuple(dims)


def positive_number(name: str, value: Any, *, allow_none: bool = False) -> float | None:
    """``value`` is a finite real number > 0 of any real type (a NumPy float too; not a bool),
    or None where ``allow_none``; returns it as a Python float."""
    if value is None and allow_none:
        return None
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not real or not 0 < value < float("inf"):
        accepted = "a positive number or None" if allow_none else "a positive number"
        raise ValueError(f"{name} must be {accepted}, got {value!r}{_number_hint(name, value)}")
    return float(value)


def flag(name: str, value: Any, *, allow_none: bool = False, none_means: str = "") -> bool | None:
    """``value`` is True or False (or None where ``allow_none``; ``none_means`` says what None
    decides, for the message); returns it. A string such as ``"no"`` or ``"false"`` is truthy
    in Python, so it would quietly mean True: refused, with the bool to pass."""
    if isinstance(value, bool) or (value is None and allow_none):
        return value
    accepted = "True or False" if not allow_none else f"True, False or None{f' ({none_means})' if none_means else ''}"
    hint = ""
    if isinstance(value, str) and value.strip().lower() in BOOLEAN_WORDS:
        hint = f"; pass {name}={BOOLEAN_WORDS[value.strip().lower()]} (the bool, not a string)"
    raise TypeError(f"{name} must be {accepted}, got {type(value).__name__} {shown(value)}{hint}")


def _number_hint(name: str, value: Any) -> str:
    """``"; pass the number, e.g. lr=0.1 (not the string '0.1')"`` where ``value`` is a string of a
    positive number (a config or environment value), else ``""``."""
    try:
        if not isinstance(value, str):
            return ""
        return f"; pass the number, e.g. {name}={value.strip()} (not the string {value!r:.20})" if 0 < float(value) < math.inf else ""
    except (TypeError, ValueError):
        return ""


#: Strings that read as a boolean, and the bool they read as.
BOOLEAN_WORDS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def module(name: str, value: Any) -> None:
    """``value`` is a ``torch.nn.Module``."""
    if isinstance(value, torch.optim.Optimizer):  # (optimizer, model): the two swapped
        raise TypeError(f"{name} must be a torch.nn.Module, got the optimizer {type(value).__name__}: "
                        "pass the model first, then its optimizer")
    if not isinstance(value, torch.nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module, got {type(value).__name__} {shown(value)}")


def materialized(name: str, model: torch.nn.Module) -> None:
    """``model`` holds no uninitialized lazy parameter (a ``LazyLinear`` before its first
    forward): a probe snapshots and a runner guards every weight before its first step, and an
    uninitialized one has no shape to copy. Nor a tensor on the meta device (a model built under
    ``torch.device("meta")``): it has no values to train, and failed inside torch's accelerator
    runtime ("Cannot access accelerator device when none is available" on a CPU machine)."""
    from torch.nn.parameter import is_lazy

    tensors = [*model.named_parameters(), *model.named_buffers()]
    on_meta = [key for key, value in tensors if value.is_meta]
    if on_meta:  # built under torch.device("meta") or init_empty_weights(): shapes, no values to train
        raise ValueError(
            f"{name} has parameters on the meta device ({', '.join(on_meta[:3])}{', ...' if len(on_meta) > 3 else ''}), "
            f"which hold no values to train: materialize it first, e.g. {name}.to_empty(device='cpu') (or the "
            f"accelerator), then initialize its weights or load_state_dict(state, assign=True)")
    lazy = [key for key, value in tensors if is_lazy(value)]
    if lazy:
        raise ValueError(
            f"{name} has uninitialized lazy parameters ({', '.join(lazy[:3])}{', ...' if len(lazy) > 3 else ''}): "
            f"run it on one batch first (e.g. {name}(make_batch(1))) so their shapes are known, then probe or train")


def optimizer(name: str, value: Any) -> None:
    """``value`` is a ``torch.optim.Optimizer``."""
    if not isinstance(value, torch.optim.Optimizer):
        raise TypeError(f"{name} must be a torch.optim.Optimizer, got {type(value).__name__} {shown(value)}")


def trains(name: str, value: Any, model: torch.nn.Module) -> None:
    """``value`` is a ``torch.optim.Optimizer`` holding at least one of ``model``'s parameters
    (one built on another model's would train nothing, or fail deep in a grad scaler's step)."""
    optimizer(name, value)
    held = {id(p) for group in value.param_groups for p in group["params"]}
    if held and not any(id(p) in held for p in model.parameters()):
        raise ValueError(f"{name} holds none of the model's parameters: build it from this model's parameters, "
                         f"e.g. torch.optim.AdamW(model.parameters())")


def no_closure(name: str, value: torch.optim.Optimizer, *, runner: bool = False) -> None:
    """``value``'s ``step()`` runs without a closure. ``LBFGS`` (and any optimizer whose step
    requires one) evaluates the loss several times per step through it; a probe trial and the
    runner's step call ``step()`` once after one backward, so such an optimizer would fail deep
    inside with ``step() missing 1 required positional argument: 'closure'``. ``runner``: the
    :class:`~autobatch.Runner` checks it (its advice is another optimizer, not another probe)."""
    try:
        closure = inspect.signature(type(value).step).parameters.get("closure")
    except (TypeError, ValueError):  # a step whose signature Python cannot read: nothing to tell
        return
    if isinstance(value, torch.optim.LBFGS) or (closure is not None and closure.default is inspect.Parameter.empty):
        needs = (f"{name}={type(value).__name__} needs a closure in step(closure) (it re-evaluates the loss several "
                 "times per step), ")
        if runner:  # the Runner trains: it cannot, with this optimizer; a probe of the user's own loop is no help there
            raise ValueError(
                needs + "and the Runner runs each micro-batch's forward and backward, then one optimizer.step() "
                "per global batch, so it cannot train with it. Use a first-order optimizer (SGD, Adam, AdamW) in the "
                "Runner, or train this optimizer in your own loop"
            )
        raise ValueError(
            needs + "and autobatch's probe steps run one forward and backward, then optimizer.step(): optimizers that "
            "need a closure are not supported there. Use a first-order optimizer (SGD, Adam, AdamW), or probe a plain "
            "callable fn(batch_size) that runs your closure step: find_max_batch(fn, restore=(model, optimizer))"
        )


def loss(name: str, value: Any) -> torch.Tensor:
    """The loss tensor to backward from what ``name`` (the loss function) returned: a scalar
    tensor; or, as the Transformers ``Trainer`` and Lightning take them, the ``"loss"`` of a
    dict or model output (``model(**batch)`` of a Transformers model given labels) or its
    ``.loss``, the rest of the output dropped before backward. A tuple is refused (which item is
    the loss is a guess), so is a tensor of more than one element (backward needs one number),
    a fake tensor outside a fake-tensor trace (:class:`~autobatch.errors.FakeTensorLeakError`),
    and a loss that does not require grad (a ``ValueError`` saying what to change, where backward
    would fail with torch's bare "element 0 of tensors does not require grad")."""
    found = value
    if isinstance(value, Mapping):
        found = value.get("loss")
    elif not isinstance(value, (torch.Tensor, tuple, list)) and hasattr(value, "loss"):
        found = value.loss
    if not isinstance(found, torch.Tensor):
        if found is value:
            what = f"{type(value).__name__} {value!r:.80}"
        elif found is None and _loss_terms(value):  # torchvision's detection models: {"loss_classifier": ..., ...}
            raise TypeError(
                f"{name} returned a {type(value).__name__} of loss terms ({', '.join(_loss_terms(value)[:6])}) and no "
                f"'loss': return their sum, e.g. loss_fn=lambda model, batch: sum(model(*batch).values()) (a torchvision "
                "detection model's losses, in train mode)")
        elif found is None:
            keys = f"its keys: {', '.join(map(str, list(value)[:6])) or 'none'}; " if isinstance(value, Mapping) else ""
            what = (f"a {type(value).__name__} without a loss ({keys}a Transformers model computes one only when the "
                    "batch has labels)")
        else:
            what = f"a {type(value).__name__} whose loss is {type(found).__name__} {found!r:.40}"
        raise TypeError(
            f"{name} must return the loss as a scalar tensor (or a dict / model output holding it as 'loss'), got "
            f"{what}; return the loss itself, e.g. "
            "loss_fn=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]) (for a tuple (loss, ...), its [0])"
        )
    if found.numel() != 1:
        raise ValueError(
            f"{name} returned a tensor of shape {tuple(found.shape)}, not a scalar loss (backward needs one number): "
            "reduce it, e.g. .mean() over the batch (reduction='mean')"
        )
    if isinstance(found, FakeTensor) and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None:
        raise FakeTensorLeakError(f"the loss {name} returned")
    if not found.requires_grad:
        raise ValueError(f"the loss {name} returned does not require grad, so backward has nothing to train "
                         f"(torch would fail with 'element 0 of tensors does not require grad'): {_why_no_grad(found)}")
    return found


def _loss_terms(value: Any) -> list[str]:
    """The keys of a dict of scalar loss tensors, every key naming a loss (``loss_box_reg``,
    ``rpn_loss``), else none."""
    if not isinstance(value, Mapping) or not value:
        return []
    terms = [str(key) for key, item in value.items()
             if "loss" in str(key).lower() and isinstance(item, torch.Tensor) and item.numel() == 1]
    return terms if len(terms) == len(value) else []


def _why_no_grad(loss: torch.Tensor) -> str:
    """What to change where ``loss`` has no autograd graph: the grad mode the step runs in, else a
    loss computed under ``torch.inference_mode()`` inside ``loss_fn`` (an inference tensor says
    so), else the loss cut from the graph or a model with nothing to train (which of the two the
    loss alone cannot tell)."""
    if torch.is_inference_mode_enabled() or not torch.is_grad_enabled():
        mode = "torch.inference_mode()" if torch.is_inference_mode_enabled() else "torch.no_grad()"
        return f"gradients are off where the step runs (inside {mode}): call it outside that block"
    if loss.is_inference():  # made under inference_mode inside loss_fn or forward, which the step left already
        return ("the loss was computed under torch.inference_mode() (inside the loss function or the model's "
                "forward), which records no graph: compute the loss with gradients on, keeping inference_mode for "
                "evaluation only")
    return ("either the loss was cut from the graph (computed under torch.no_grad() or torch.inference_mode(), with "
            ".detach(), or rebuilt from .item() or a Python number: return the tensor computed from the model's "
            "output), or no parameter it "
            "depends on has requires_grad=True (a frozen model: unfreeze some, e.g. model.head.requires_grad_(True), "
            "and give the optimizer only those, "
            "torch.optim.AdamW(p for p in model.parameters() if p.requires_grad)), or those that do are inside a "
            "torch.utils.checkpoint.checkpoint(..., use_reentrant=True) whose inputs do not require grad (LoRA adapters "
            "in blocks after a frozen embedding), which gives them no gradient: pass use_reentrant=False (Transformers: "
            "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}))")


def function(name: str, value: Any, signature: str) -> None:
    """``value`` is callable; ``signature`` shows how it is called, for the message. One of
    torch's criteria (``nn.CrossEntropyLoss()``) is callable too, but as ``criterion(output,
    target)``: refused here with the wrapper to write, not at the first step inside torch."""
    if not callable(value):
        raise TypeError(f"{name} must be a callable {signature}, got {type(value).__name__} {shown(value)}")
    forward = getattr(type(value), "forward", None)
    if isinstance(value, torch.nn.modules.loss._Loss) and getattr(forward, "__module__", "").startswith("torch."):
        # torch's criterion (a subclass's own forward may well take (model, batch)): called as criterion(output, target)
        raise TypeError(
            f"{name} is called as {signature}, and {type(value).__name__}() is a criterion, called as "
            f"criterion(output, target) (it failed at the first step with \"argument 'input' must be Tensor, not "
            f"Module\"); wrap it, e.g. {name}=lambda model, batch: criterion(model(batch[0]), batch[1])")


def choice(name: str, value: Any, choices: tuple[str, ...], *, aliases: Mapping[str, str] | None = None) -> str:
    """``value``, one of ``choices`` (strings), or one ``ValueError`` naming them and the closest
    (``'bianry'``: ``'binary'``; ``'Binary'``: its lower case; an ``aliases`` key, a peer's
    name for one of them, such as Lightning's ``'binsearch'``: the choice it means)."""
    if isinstance(value, str) and value in choices:
        return value
    guess = None
    if isinstance(value, str):
        folded = value.strip().lower()
        guess = folded if folded in choices else closest(folded, choices, aliases)
    hint = f"; did you mean {name}={guess!r}?" if guess else ""
    raise ValueError(f"{name} must be one of {', '.join(choices)}; got {shown(value)}{hint}")


def dtype(name: str, value: Any, *, allowed: tuple[torch.dtype, ...] | None = None) -> torch.dtype | None:
    """``value`` as a ``torch.dtype``: None, a dtype, or its name ("bfloat16", "float16", also
    "torch.bfloat16"); with ``allowed``, one of those (an autocast dtype: an integer type would
    be taken by ``torch.autocast`` without a word, or refused deep inside)."""
    if value is None:
        return None
    resolved = value
    if isinstance(value, str):
        resolved = getattr(torch, value.strip().removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"{name}={value!r} is not a torch dtype; use e.g. 'bfloat16' or 'float16'")
    if allowed is not None and resolved not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{name}={value!r} is not one of {names}; use e.g. torch.bfloat16 (or 'bfloat16')")
    return resolved


def grad_scaler(name: str, value: Any) -> Any:
    """``value`` is None or a ``torch.amp.GradScaler`` (the older ``torch.cuda.amp.GradScaler``
    is one); returns it. Anything else (``True``) failed at the first step's ``is_enabled()``."""
    if value is None or isinstance(value, torch.amp.GradScaler):
        return value
    raise TypeError(
        f"{name} must be a torch.amp.GradScaler or None, got {type(value).__name__} {shown(value)}; "
        f"for fp16 pass {name}=torch.amp.GradScaler(device) (with autocast_dtype=torch.float16)"
    )


def scheduler(name: str, value: Any) -> Any:
    """``value`` is None or a scheduler whose ``step()`` takes no argument (the runner steps it
    after every optimizer step, with no metric: ``ReduceLROnPlateau`` needs one); returns it."""
    if value is None:
        return None
    if not callable(getattr(value, "step", None)):
        raise TypeError(f"{name} must be an LR scheduler (with step()) or None, got {type(value).__name__}")
    if isinstance(value, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError(
            f"{name}=ReduceLROnPlateau needs a metric at each step(), and the runner steps {name} after every optimizer "
            f"step with none; pass {name}=None and step it yourself in on_step_end(info) with info['loss'] (or a "
            "validation metric), and pass it in extra_state={'plateau': scheduler} so checkpoints keep its state"
        )
    return value


def record_fields(kind: type, data: Any, owner: str, *, what: str = "the dict", is_not: str = "", source: str = "",
                  exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """The items of ``data`` that are fields of the dataclass ``kind`` (less ``exclude``), for a
    record's ``from_dict`` (``owner``: ``ProbeResult``, ``Plan``, ``RunResult``): keys another
    version or a report added are left out, a field an older version lacked takes its default.
    Anything else is one error naming what to pass: JSON text instead of a dict (it failed as
    ``'str' object has no attribute 'items'``), or a dict (``what``) without ``kind``'s required
    fields, "so it is ``is_not``", pass what ``source`` names."""
    if not isinstance(data, Mapping):
        text = " (JSON text: pass json.loads(text))" if isinstance(data, (str, bytes)) else ""
        raise TypeError(f"{owner}.from_dict takes the dict {owner}.to_dict() wrote, got {type(data).__name__}{text}")
    every = dataclasses.fields(kind)
    missing = [f.name for f in every
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in data]
    if missing:
        raise ValueError(f"{owner}.from_dict: {what} lacks {', '.join(missing)}, so it is {is_not}; pass the dict "
                         f"{owner}.to_dict() wrote ({source})")
    known = {f.name for f in every} - set(exclude)
    return {key: value for key, value in data.items() if key in known}


def strict_json(value: Any) -> Any:
    """``value`` (a record's dicts, lists and numbers) with every NaN or infinite float as None, for
    a record's ``to_dict``: ``json.dumps`` writes them as ``NaN``/``Infinity``, which is no JSON
    (``jq``, ``JSON.parse`` refuse the whole file). None there means "no finite figure": a plan
    candidate whose median step measured 0 s (the clock did not resolve it) has ``samples_per_s``
    null, as the command line's ``metrics.jsonl`` writes a zero-second step's."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value
