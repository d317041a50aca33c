"""A note naming a ``data.dataset``'s inputs, on a model of one's own whose first forward cannot take them.

``python -m autobatch probe model=target model._target_=mylab.Net +data.dataset._target_=mylab.DS``
with a dataset whose ``__getitem__`` returns numpy's float64 arrays failed in the model with "mat1 and
mat2 must have the same dtype, but got Double and Float"; one returning Python lists failed with
"linear(): argument 'input' must be Tensor, not list" (torch's default collate turns a batch of lists
into a list of per-position tensors); one returning a tuple of inputs to a ``forward(a, b)`` failed
with "forward() missing 1 required positional argument" raised inside autobatch. None of them named
the dataset or what to return from it. :func:`dataset_inputs_note` is the note
:func:`autobatch.cli.input_note.inputs_noted` adds there (the synthetic data's note is
:func:`~autobatch.cli.input_note.inputs_note`): the dataset's first input as the model got it, and the
change to make.
"""

from __future__ import annotations

from numbers import Number
from typing import Any

import torch
from omegaconf import DictConfig

__all__ = ["dataset_inputs_note", "forward_type_error"]


def forward_type_error(exc: BaseException, model: torch.nn.Module) -> bool:
    """Whether ``exc`` is a ``TypeError`` of an input the model cannot take: a non-tensor given to a
    torch op (``must be Tensor, not list``) or a call to the model's ``forward`` with too few or
    too many arguments (raised at the call, outside the model's code)."""
    if not isinstance(exc, TypeError):
        return False
    text = str(exc)
    return "must be Tensor, not" in text or f"{type(model).__name__}.forward()" in text


def _describe(inputs: Any) -> str:
    """One sample's input, as ``__getitem__`` returned it."""
    if isinstance(inputs, torch.Tensor):
        return f"a {str(inputs.dtype).replace('torch.', '')} tensor of shape {list(inputs.shape)}"
    if hasattr(inputs, "__array__") and hasattr(inputs, "dtype") and hasattr(inputs, "shape"):
        return f"a {type(inputs).__module__.split('.')[0]} {inputs.dtype} array of shape {list(inputs.shape)}"
    if isinstance(inputs, (tuple, list)):
        kinds = sorted({type(item).__name__ for item in inputs})
        return f"a Python {type(inputs).__name__} of {len(inputs)} items ({', '.join(kinds)})"
    if isinstance(inputs, dict):
        return f"a dict with keys {', '.join(map(str, list(inputs)[:6]))}"
    return f"a {type(inputs).__name__}"


def _fix(inputs: Any, model: torch.nn.Module) -> str:
    """What to change in the dataset (or the model) for ``inputs``."""
    weights = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    wanted = str(weights).replace("torch.", "")
    if isinstance(inputs, (tuple, list)) and inputs and all(isinstance(item, Number) for item in inputs):
        return (f"torch's default collate turns a batch of lists into a list of {len(inputs)} tensors (one per "
                f"position), not one tensor: return a tensor from __getitem__ (torch.tensor(x, dtype=torch.{wanted}))")
    if isinstance(inputs, (tuple, list)):
        return (f"the model is called with the batch's input as one argument, model(inputs), here a {type(inputs).__name__} "
                f"of {len(inputs)}: take it as one argument in forward and unpack it (def forward(self, inputs): a, b = "
                "inputs), or return one tensor as the input")
    dtype = getattr(inputs, "dtype", None)
    name = str(dtype).replace("torch.", "")
    if dtype is not None and name.startswith("float") and name != wanted:
        return (f"the model's weights are {wanted}: return {wanted} inputs from __getitem__ "
                f"(torch.as_tensor(x, dtype=torch.{wanted}))")
    return "return from __getitem__ the input the model's forward takes (its shape for one sample, its dtype)"


def dataset_inputs_note(cfg: DictConfig, model: torch.nn.Module, dataset: Any) -> str | None:
    """The note for an error raised by the first forward of ``model`` (the user's ``_target_``) on
    ``dataset``'s batch; None when the dataset's first sample cannot be read as ``(input, target)``."""
    try:
        inputs = dataset[0][0]
    except Exception:  # noqa: BLE001 - the note is advice; the error itself stands as raised
        return None
    target = cfg.model.get("_target_")
    return (f"{target} was fed data.dataset={cfg.data.dataset.get('_target_')}'s inputs, each {_describe(inputs)} "
            f"(data.dataset[0][0], collated by torch's default collate); {_fix(inputs, model)}")
