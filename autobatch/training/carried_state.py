"""Per-sample state a model carries from one forward to the next: named where the runner's split breaks it.

A stateful recurrent model (truncated backpropagation through time) keeps its hidden state on a
module between steps (``self.hidden = h.detach()``, ``[layers, B, H]``) and starts the next
forward from it: row ``i`` of that state belongs to sample ``i`` of the batch that made it. The
runner trains a global batch in micro-batches (an OOM replay in smaller ones), so each
micro-batch's forward reads the state the one before it left, other samples'. Where the pieces are
of one size that trained silently on the wrong state; where they are not (a replay's smaller
pieces) torch raised ``Expected hidden[0] size (2, 4, 4), got [2, 8, 4]`` from inside the LSTM,
and the runner's note blamed BatchNorm and advised a ``min_micro_batch``.

:func:`carried_tensors` finds such state: a plain attribute of a module (not a parameter or a
buffer), a tensor or a tuple or list of them (an LSTM's ``(h, c)``), of two dims or more, whose
dim 0 or 1 is one of the given sizes. :func:`warn_carried_state` warns once, at the runner's first
step trained in several pieces; :func:`note_carried_state` adds a note to an error a forward raised
at a micro-batch of another size than the state's. The fix both name keeps the split exact: one
state row for every sample of the global batch in a registered buffer, read and written at each
sample's index carried in the batch (the runner splits the index with the inputs, a replay puts
buffers back, checkpoints hold them), or training whole batches only. Only a tensor whose name
the model's forward code reads (:func:`~.forward_reads.forward_reads`) is named: a cache forward
only writes (``self.last_attn = attn.detach()``, attention weights kept for plotting) is harmless.
"""

from __future__ import annotations

import logging

import torch

from ..errors import add_note
from .forward_reads import forward_reads
from .inputs import _sizes_text

__all__ = ["carried_tensors", "read_back", "warn_carried_state", "note_carried_state"]

log = logging.getLogger("autobatch")


def carried_tensors(model: torch.nn.Module, sizes: set[int]) -> list[tuple[str, tuple[int, ...], int]]:
    """``(where, shape, size)`` of every tensor kept as a plain attribute of a module of ``model``
    (alone, or in a tuple or list of tensors) whose dim 0 or dim 1 is in ``sizes``; parameters,
    buffers and submodules are not plain attributes, so they are never among them."""
    found = []
    held = {id(tensor) for tensor in (*model.parameters(), *model.buffers())}  # an LSTM's _flat_weights lists its own
    for name, module in model.named_modules():
        for attribute, value in vars(module).items():
            items = value if isinstance(value, (tuple, list)) and value else (value,)
            if not all(isinstance(item, torch.Tensor) and id(item) not in held for item in items):
                continue
            for item in items:
                hit = next((n for n in item.shape[:2] if n in sizes), None) if item.dim() >= 2 else None
                if hit is not None:
                    found.append((f"{name or 'model'}.{attribute}", tuple(item.shape), hit))
                    break
    return found


def read_back(model: torch.nn.Module, sizes: set[int]) -> list[tuple[str, tuple[int, ...], int]]:
    """Those of :func:`carried_tensors` whose attribute name the forward code of ``model`` reads
    (:func:`~.forward_reads.forward_reads`; all of them where it cannot tell): a write-only cache is
    left out. The code is read only where such a tensor is found."""
    found = carried_tensors(model, sizes)
    reads = forward_reads(model) if found else None
    return found if reads is None else [hit for hit in found if hit[0].rpartition(".")[2] in reads]


def _advice(global_batch: int) -> str:
    return (f"To carry it exactly (a recurrent hidden state carried between steps), keep one state for every "
            f"sample of the global batch in a registered buffer (self.register_buffer('hidden', torch.zeros(layers, "
            f"{global_batch}, hidden_size))), put each sample's index in the batch (torch.arange({global_batch}) beside "
            "the inputs: the runner splits it with them) and read and write self.hidden[:, index] in forward (an OOM "
            "replay puts buffers back, checkpoints keep them); or train whole batches only (micro_batch=global_batch, "
            "min_micro_batch=global_batch: an OOM then raises StepOutOfMemoryError instead of splitting)")


def warn_carried_state(model: torch.nn.Module, sizes: list[int], global_batch: int) -> bool:
    """Warn, once a step trained in several micro-batches (``sizes``), where a module of ``model``
    keeps a tensor sized by one of them that its forward code reads: each micro-batch's forward may
    read the one before it left. Returns whether it warned."""
    found = read_back(model, set(sizes))
    if not found:
        return False
    where, shape, size = found[0]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    log.warning(
        "%s %s%s is kept on the module from one forward to the next, is sized by a micro-batch (%d samples) and is "
        "read by the model's forward code: the runner trained this global batch of %d in micro-batches of %s (an OOM "
        "replay cuts smaller ones), so state carried so belongs to other samples when the next micro-batch's forward "
        "reads it. %s",
        where, shape, more, size, sum(sizes), _sizes_text(sizes), _advice(global_batch),
    )
    return True


def note_carried_state(exc: BaseException, model: torch.nn.Module, pieces: list[int], trained: set[int],
                       global_batch: int) -> bool:
    """Add a note to ``exc``, raised in forward at micro-batches of ``pieces``, where a module of
    ``model`` keeps a tensor sized by a micro-batch size that trained earlier (``trained``) and by
    none of ``pieces``: the model likely read it with this micro-batch's samples. Returns whether it did."""
    found = read_back(model, trained - set(pieces))
    if not found:
        return False
    where, shape, size = found[0]
    add_note(exc,
        f"autobatch: {where} {shape}, kept on the module from an earlier forward, is sized by an earlier micro-batch "
        f"({size} samples), and this error came at a micro-batch of {' or '.join(map(str, sorted(set(pieces))))}: the "
        "runner trains a global batch in micro-batches and an OOM replay in smaller ones, so state a model carries "
        f"between forwards does not match the next micro-batch's samples. {_advice(global_batch)}. The step was undone.")
    return True
