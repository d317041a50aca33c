"""Whether a step's memory depends on the batch's content, told from the steps of one trial.

A step whose batch is padded to its longest sequence, or whose mixture-of-experts layer routes
samples by their values, takes more memory for one batch than for another of the same size. The
probe's answer then holds for the batches its trials drew, and nothing said so: on the CPU's
simulated device (8 MiB) a token model whose ``make_batch`` padded to the longest sequence, one
sample in 500 being 512 long and the rest 8-63, answered 69, where a batch holding one long
sequence fits 9; an MoE step's answer ran out of memory in its first training steps. Steps of one
trial run at the same size, so where the batch shapes its ``make_batch`` built differ, or their
peaks above their start differ (after the first step, which makes lazily created state), by more
than :data:`SPREAD` of the larger, :func:`content_note` says so, with the shapes and peaks it saw.
A step whose fake-tensor trace (``estimate_first``) stopped at an operator whose output's shape depends on
the values (``nonzero``, boolean-mask indexing: a top-k mixture-of-experts layer gathering each expert's
tokens; ``F.ctc_loss``, sized by the batch's longest target) depends on its content by construction too,
and its trials' steps need not show it: a top-2-of-4 MoE step answered 217 under 600,000 simulated bytes,
its steps' peaks within 1 %, where a batch routed otherwise fits 216, and the Runner replayed its first
step. :func:`shapes_note` says so where :func:`content_note` had nothing to say.
A step with sparse gradients depends on its batch's content by construction, often by less than
that (a ``sparse=True`` embedding's gradient has a row per token id the batch happens to touch):
:func:`sparse_note` says so whatever the trials' peaks showed.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_leaves

from ..memory.units import format_bytes
from .tracing.fake_trace import loss_module
from .tracing.trace_failures import sparse_embeddings, sparse_gradients
from .train_step import TrainStep

__all__ = ["drawn_shapes", "content_note", "sparse_note", "sparse_momentum_note", "trained_parts", "shapes_note", "SPREAD", "DATA_SHAPED"]

#: Peaks of steps at one size differing by more than this fraction of the larger tell of content.
SPREAD = 0.01


@contextmanager
def drawn_shapes(fn: Any) -> Iterator[list]:
    """While the block runs, the shapes of the tensors in each batch a ``TrainStep``'s
    ``make_batch`` builds are appended to the list yielded (nothing for a plain callable, whose
    batch the probe cannot see). The step's own ``make_batch`` is put back after."""
    shapes: list = []
    make = fn.make_batch if isinstance(fn, TrainStep) else None
    if make is None or isinstance(type(fn).__dict__.get("make_batch"), property):  # no batches of its own to see
        yield shapes
        return
    own = "make_batch" in vars(fn)

    def recorded(batch_size: int) -> Any:
        batch = make(batch_size)
        shapes.append(tuple(tuple(leaf.shape) for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor)))
        return batch

    fn.make_batch = recorded
    try:
        yield shapes
    finally:
        if own:
            fn.make_batch = make
        else:
            del fn.make_batch


def content_note(steps: dict[int, list[tuple[int, tuple]]], records: list, batch_size: int) -> str | None:
    """The note on a probe whose steps at one size built batches of other shapes or peaked
    differently (``steps``: :class:`~autobatch.probe.held_growth.HeldGrowth`'s, by trial index of
    ``records``); None where none did. The trial told of is the answer's latest passing one where
    it shows it, else the one whose peaks spread most."""
    found = []
    for index, record in enumerate(records):
        calls = steps.get(index, [])
        if not record.passed or len(calls) < 2:
            continue
        shapes = list(dict.fromkeys(shape for _, shape in calls))
        later = [peak for peak, _ in calls[1:]]
        spread = (max(later) - min(later)) / max(max(later), 1) if len(later) > 1 else 0.0
        if len(shapes) > 1 or spread > SPREAD:
            found.append((record.batch_size == batch_size, spread, index, record.batch_size, shapes, later))
    if not found:
        return None
    _, spread, _, size, shapes, later = max(found, key=lambda item: (item[0], item[1], item[2]))
    drew = ""
    if len(shapes) > 1:
        varied = [k for k in range(len(shapes[0])) if len({shape[k] if k < len(shape) else None for shape in shapes}) > 1]
        leaf = varied[0] if varied else 0
        drew = "built inputs shaped " + ", ".join(
            str(list(shape[leaf])) if leaf < len(shape) else "(none)" for shape in shapes[:4]) + ("..." if len(shapes) > 4 else "")
    if spread > SPREAD:
        drew += (" and " if drew else "") + f"peaked {format_bytes(min(later))} to {format_bytes(max(later))} above their start"
    return (
        f"steps of one size took different memory, as a step whose memory depends on the batch's content does: "
        f"batch {size}'s steps {drew}. The answer, {batch_size}, holds "
        "for the batches the trials drew, not for every batch: one that takes more (longer sequences padded to its "
        "longest, more samples routed to one expert) can run out of memory at it. Have make_batch build the costliest "
        "batch training will see (pad to the longest length) and probe again, pass margin= to leave room, or train "
        "with autobatch's Runner, which replays a step that runs out of memory in smaller micro-batches."
    )


def trained_parts(trained: Any, restore: tuple | None) -> tuple[list[tuple[str, torch.nn.Module]], tuple]:
    """What the sparse notes look at, each module once: the modules (with the prefix their layers' names take)
    and the optimizers of ``trained`` (a ``TrainStep``: its model, its loss module (``loss_fn=criterion``,
    :func:`~autobatch.probe.tracing.fake_trace.loss_module`) and its optimizer; or a model) and of ``restore``
    (which a plain callable's probe looks at). One in the loss module got no note before (the model alone,
    or ``restore``'s modules, were looked at)."""
    items = tuple(restore or ())
    if isinstance(trained, TrainStep):
        modules = [("", trained.model), ("loss_fn.", loss_module(trained))]
        items += (trained.optimizer,)
    else:  # a model, or a plain callable (whose model is ``restore``'s)
        modules = [("", trained)] if isinstance(trained, torch.nn.Module) else []
    modules = [(prefix, module) for prefix, module in modules if module is not None]
    seen = {id(module) for _, module in modules}
    modules += [("", item) for item in items if isinstance(item, torch.nn.Module) and id(item) not in seen]
    optimizers = tuple(dict.fromkeys(item for item in items if isinstance(item, torch.optim.Optimizer)))
    return modules, optimizers


def _sparse_tables(modules: list[tuple[str, torch.nn.Module]]) -> Iterator[tuple[str, torch.nn.Module]]:
    """Each ``sparse=True`` embedding of ``modules`` (:func:`trained_parts`'), with the name a note gives it."""
    for prefix, module in modules:
        for name, table in sparse_embeddings(module):
            yield (f"{prefix}{name}" if prefix and name else ("the loss module" if prefix else name or "the model")), table


def sparse_note(trained: Any, restore: tuple | None, batch_size: int) -> str | None:
    """The note on a probe of a step whose gradients are sparse (a ``sparse=True`` embedding in what
    ``trained`` or ``restore`` trains, :func:`trained_parts`; ``SparseAdam`` in ``restore`` or the step's
    optimizer); None otherwise. Their memory grows with the rows the batch touches, so another batch
    of the same size can take more than every trial's did, by less than :data:`SPREAD`, which :func:`content_note` would not tell: on the CPU's simulated device
    (8 MiB) a ``SparseAdam`` embedding step's steps at its answer, 130, peaked 7.95-8.01 MiB, its
    trials' batches passed (at 99.6 % of the budget) and training at it ran out of memory at its
    first step."""
    modules, optimizers = trained_parts(trained, restore)
    reason = next((name for name, _ in _sparse_tables(modules)), None)
    if reason is not None:
        reason += " has sparse gradients, whose size depends on the data"
    else:
        reason = sparse_gradients(None, optimizers)
    if reason is None:
        return None
    return (
        f"{reason}: another batch of {batch_size} can touch more rows, and take more memory, than the trials' did, "
        "so the answer holds for the batches the trials drew, not for every batch. Pass margin= (a few percent) "
        "to leave room, or train with autobatch's Runner, which replays a step that runs out of memory in smaller "
        "micro-batches."
    )


def sparse_momentum_note(trained: Any, restore: tuple | None = None) -> str | None:
    """The note (and the runner's warning) for ``torch.optim.SGD`` with momentum training a ``sparse=True``
    embedding of what ``trained`` or ``restore`` trains (:func:`trained_parts`: a ``TrainStep``'s loss module
    too, whose embedding got no note before): torch keeps that momentum as a sparse tensor it never
    coalesces, ``buf.mul_(momentum).add_(grad)``, so it grows by every step's lookups without bound
    (an ``EmbeddingBag(4000, 16)`` looked up 3072 times a step held 15349 rows after 5 steps), and a
    step that fits now runs out of memory later at any batch size; the runner replayed it in ever
    smaller micro-batches and gave up advising SGD. None otherwise."""
    modules, optimizers = trained_parts(trained, restore)
    sparse = {id(table.weight): name for name, table in _sparse_tables(modules)}
    for optimizer in optimizers:
        for group in optimizer.param_groups if isinstance(optimizer, torch.optim.SGD) else ():
            name = next((sparse[id(p)] for p in group["params"] if id(p) in sparse), None)
            if group.get("momentum") and name is not None:
                return (f"torch.optim.SGD with momentum={group['momentum']} trains {name!r}, a sparse=True "
                        "embedding: torch keeps its momentum as a sparse tensor it never coalesces, which grows by every "
                        "step's rows without bound, so a step that fits now runs out of memory later, at any batch size. "
                        "Give that embedding a param group with momentum=0, train with torch.optim.Adagrad (dense "
                        "state), or build it with sparse=False")
    return None


#: the start of :func:`~autobatch.probe.tracing.trace_failures.untraceable`'s words for an operator whose output's shape
#: depends on the data (a fake tensor cannot know it), as the estimate's note holds them
DATA_SHAPED = "DynamicOutputShapeException"


def shapes_note(estimate_note: str | None, batch_size: int) -> str | None:
    """The note on a probe whose estimate could not trace the step past an operator whose output's shape
    depends on the data (``estimate_note`` holds :data:`DATA_SHAPED`); None otherwise."""
    if not estimate_note or DATA_SHAPED not in estimate_note:
        return None
    return (
        f"the step runs an operator whose output's shape depends on the batch's values (see the estimate's note: "
        f"nonzero or boolean-mask indexing, as a mixture-of-experts layer routing tokens to experts does; "
        f"ctc_loss, sized by the longest target), so its memory depends on the batch's content: the answer, "
        f"{batch_size}, holds for the batches the trials drew, and another batch of {batch_size} (more tokens "
        "routed to one expert) can run out of memory at it. Pass margin= to leave room, have make_batch build the "
        "costliest batch training will see, or train with autobatch's Runner, which replays a step that runs out "
        "of memory in smaller micro-batches."
    )
