"""A note naming the synthetic inputs the command line built, on a model of one's own that cannot take them.

``python -m autobatch train model=target model._target_=mymods.Net`` (a model taking 8 features)
fed the default ``data.shape=[3, 32, 32]`` and failed deep in the model with "mat1 and mat2 shapes
cannot be multiplied (768x32 and 8x16)", which names neither the inputs nor the key that made them.
When the model's *first* forward fails with a shape or dtype error (never an out-of-memory one),
the model is a ``_target_`` of the user's own and the data is synthetic, :func:`inputs_noted` adds
one note (``add_note``; the error keeps its type, message and traceback) naming the inputs built
(``data.shape=[...] per sample``, the dtype) and the options that set them; the command line's
one-line error appends the note (:func:`autobatch.cli.errors.describe`). With a ``data.dataset`` the
note is :func:`~autobatch.cli.dataset_note.dataset_inputs_note`'s, naming the dataset's inputs.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

import torch
from omegaconf import DictConfig

from ..errors import add_note, raised_through
from ..memory.oom import is_oom_error
from .dataset_note import dataset_inputs_note, forward_type_error

__all__ = ["inputs_noted", "input_mismatch", "inputs_note"]

W = TypeVar("W")

#: Words of torch's (and common models') errors on an input of the wrong shape or dtype. (A token
#: id past an embedding's size, "index out of range in self", has the probe's own note already.)
_MISMATCH = (
    "shapes cannot be multiplied", "size mismatch", "is invalid for input of size", "must match the size of tensor",
    "same dtype", "expected scalar type", "should be the same", "expected input", "channels, but got",
    "Expected 2D", "Expected 3D", "Expected 4D", "Dimension out of range", "too many indices",
    "following scalar types", "normalized_shape", "but got input of size",
)  # fmt: skip


def input_mismatch(exc: BaseException) -> bool:
    """Whether ``exc`` reads as an input of the wrong shape or dtype (an OOM never does)."""
    if is_oom_error(exc) or not isinstance(exc, (RuntimeError, ValueError, IndexError)):
        return False
    text = str(exc).lower()
    return any(words.lower() in text for words in _MISMATCH)


def _own_target(cfg: DictConfig) -> str | None:
    """The model's ``_target_`` when it is not one of autobatch's models, else None."""
    target = cfg.model.get("_target_") if isinstance(cfg.model, DictConfig) else None
    return str(target) if target and not str(target).startswith("autobatch.") else None


def inputs_note(cfg: DictConfig) -> str:
    """The synthetic inputs the command line builds for ``cfg`` and the keys that set them."""
    target, data = _own_target(cfg) or "the model", cfg.data
    inputs = getattr(cfg.model.get("inputs", "tensor"), "name", str(cfg.model.get("inputs", "tensor")))
    if inputs == "tokens":
        return (f"{target} was fed synthetic token ids (model.inputs=tokens): int64, data.seq_len={data.seq_len} per "
                f"sample (a batch of N is [N, {data.seq_len}]), each below data.vocab_size={data.vocab_size}; set "
                f"data.seq_len and data.vocab_size to what {target} takes, or model.inputs=tensor for float tensors "
                "of data.shape")
    shape = [int(size) for size in data.shape]
    dtype = getattr(data.dtype, "name", str(data.dtype))
    return (f"{target} was fed synthetic inputs of data.shape={shape} per sample (a batch of N is "
            f"[N, {', '.join(map(str, shape))}]), data.dtype={dtype} (model.inputs=tensor); set data.shape to one "
            f"sample's shape as {target} takes it (without the batch dimension; data.dtype for another dtype), or "
            "model.inputs=tokens for token ids")


def _model_files(model: torch.nn.Module) -> set[str]:
    """The source files of the model's class and its submodules' classes (where its forward runs)."""
    files = set()
    for module in model.modules():
        try:
            files.add(inspect.getsourcefile(type(module)) or "")
        except TypeError:  # a class defined in C or interactively
            continue
    return files - {""}


@contextmanager
def inputs_noted(cfg: DictConfig) -> Iterator[Callable[[W], W]]:
    """Yield ``watch(workload)``, which watches ``workload.model`` from then on; an input
    mismatch raised before the model's first forward returned gets :func:`inputs_note`, when the
    model is the user's own ``_target_``, the data synthetic, and the error passed through the
    model's code (with a ``data.dataset``, its note; also on a ``TypeError`` of the inputs). The exception is re-raised as it is (type, message, traceback)."""
    watched: dict[str, Any] = {}

    def forwarded(*_: Any) -> None:  # the first forward returned: no hook on the training steps after it
        watched["done"] = True
        watched.pop("hook").remove()

    def watch(workload: W) -> W:
        model = getattr(workload, "model", None)
        if isinstance(model, torch.nn.Module) and _own_target(cfg):
            watched.update(files=_model_files(model), model=model, dataset=getattr(workload, "dataset", None))
            watched["hook"] = model.register_forward_hook(forwarded)
        return workload

    try:
        yield watch
    except Exception as exc:
        files, model, dataset = watched.get("files"), watched.get("model"), watched.get("dataset")
        if not files or watched.get("done"):
            raise
        in_model = any(frame[1] in files for frame in raised_through(exc))
        if dataset is None and input_mismatch(exc) and in_model:
            add_note(exc, inputs_note(cfg))
        elif dataset is not None and ((input_mismatch(exc) and in_model) or forward_type_error(exc, model)):
            note = dataset_inputs_note(cfg, model, dataset)
            if note:
                add_note(exc, note)
        raise
    finally:
        if "hook" in watched:
            watched["hook"].remove()
