"""Gradient accumulation that keeps the global batch: split, weight, backward, never step.

This is the one accumulation implementation: users, the planner's throughput measurement and
the training runner all call it, so "micro-batch x accumulation" means the same thing
everywhere.

Split policy. ``split_batch(batch, m)`` cuts dim 0 into chunks of ``m`` samples; when ``m``
does not divide the batch, the *last* chunk is smaller (``10`` by ``4`` gives ``4, 4, 2``).
``balanced=True`` keeps the same number of chunks, ``ceil(B / m)``, but spreads the samples
so chunk sizes differ by at most one (``10`` by ``4`` gives ``4, 3, 3``); no chunk is ever
larger than ``m``, so a micro-batch size that fits memory fits either way. No sample is
dropped or repeated. ``min_micro_batch`` (the runner's, for a model that cannot train on fewer
samples) makes no chunk smaller: where a chunk would be, the batch is cut into fewer balanced
chunks, at most one sample larger than ``m`` (``15`` by ``2``, at least ``2``: ``3, 2, 2, 2, 2,
2, 2``, not ``2`` seven times and ``1``), or it is one error.

Weighting. The loss of a micro-batch of ``n`` samples is multiplied by ``n / global_batch``
before ``backward``. With a ``loss_fn`` that returns the *mean* over its micro-batch, the
accumulated gradient is then the gradient of the mean over the whole global batch, exactly
(up to floating-point summation order), whether or not the chunks are equal.
"""

from __future__ import annotations

import math
import numbers
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Iterable, Iterator

import torch

from .. import checks
from ..probe.train_step import TrainStep, autocast_factory, check_loop_inputs
from .samples import batch_size_of, cycle_samples, map_samples, narrow, take_samples  # here too: where callers have found them

__all__ = [
    "batch_size_of", "check_global_batch", "check_samples", "micro_batch_sizes", "split_batch", "cut_batch",
    "map_samples", "take_samples", "cycle_samples", "accumulate_gradients", "accumulate_micro_batches",
    "accumulate_loss_sum", "accumulated_step", "AccumulatingStep", "LazyMicroBatches",
]


def check_global_batch(global_batch: Any, *, given: int | None = None, integer: bool = False) -> None:
    """``ValueError`` unless ``global_batch`` is a positive integer (a float too, unless
    ``integer``: FSDP weights by the mean share per rank) and at least the ``given`` samples.
    Every micro-batch's loss is weighted by ``size / global_batch``: 0 divided by zero, a
    negative one flipped the gradient and the optimizer climbed the loss, a smaller one
    scaled the gradient up, all silently."""
    kinds = numbers.Integral if integer else (numbers.Integral, float)
    if isinstance(global_batch, bool) or not isinstance(global_batch, kinds) or not 0 < global_batch < math.inf:
        raise ValueError("global_batch must be a positive integer (the samples of one optimizer step), "
                         f"got {global_batch!r}")
    if given is not None and global_batch < given:
        raise ValueError(f"global_batch={global_batch} is smaller than the {given} samples given: pass the whole "
                         f"global batch (at least {given}), or leave it out for the batch's size")


def micro_batch_sizes(global_batch: int, micro_batch: int, *, balanced: bool = False,
                      min_micro_batch: int = 1) -> list[int]:
    """The micro-batch sizes that cover ``global_batch`` exactly with micro-batches of at most
    ``micro_batch``: ``ceil(global_batch / micro_batch)`` of them.

    Default: full chunks, last one smaller. ``balanced``: sizes differ by at most one, larger
    ones first. ``min_micro_batch``: no piece is smaller (a model that cannot train on fewer
    samples, BatchNorm on one): where the split leaves a smaller piece, the batch is cut into
    fewer pieces, ``global_batch // min_micro_batch``, balanced, so a piece may hold
    ``micro_batch + 1`` samples; where that is not enough either it is one ``ValueError`` naming
    both. A batch smaller than ``min_micro_batch`` is one piece (that error where it holds more
    than ``micro_batch + 1`` samples): there is nothing to split.

    >>> micro_batch_sizes(10, 4), micro_batch_sizes(10, 4, balanced=True)
    ([4, 4, 2], [4, 3, 3])
    >>> micro_batch_sizes(15, 2, balanced=True, min_micro_batch=2)
    [3, 2, 2, 2, 2, 2, 2]
    """
    global_batch, micro_batch, min_micro_batch = (
        checks.positive_int(name, value) for name, value in (("global_batch", global_batch), ("micro_batch", micro_batch),
                                                           ("min_micro_batch", min_micro_batch)))
    checks.flag("balanced", balanced)  # a string is truthy: balanced="no" balanced the sizes without a word
    steps = math.ceil(global_batch / micro_batch)
    if balanced:
        sizes = _balanced(global_batch, steps)
    else:
        full, tail = divmod(global_batch, micro_batch)
        sizes = [micro_batch] * full + ([tail] if tail else [])
    if sizes[-1] >= min_micro_batch:  # the smallest piece is the last, either way
        return sizes
    steps = max(1, min(steps, global_batch // min_micro_batch))
    sizes = _balanced(global_batch, steps)
    if sizes[0] > micro_batch + 1:  # a batch below min_micro_batch is one piece: "1 of 8 leave -3 over" said nothing
        left = (f"{steps} of {min_micro_batch} leave {global_batch - steps * min_micro_batch} over"
                if global_batch >= min_micro_batch else f"it has fewer samples than that, so it is one piece of {global_batch}")
        raise ValueError(
            f"global_batch={global_batch} cannot be cut into micro-batches of at least min_micro_batch="
            f"{min_micro_batch} and at most {micro_batch + 1} samples (one more than micro_batch={micro_batch}): "
            f"{left}. Lower min_micro_batch, "
            "or use a global batch of more samples (a DataLoader's short last batch: drop_last=True)"
        )
    return sizes


def check_samples(size: int) -> None:
    """``ValueError`` for a batch of no samples: there is nothing to split or accumulate (it
    was blamed on ``global_batch``, which the caller may never have passed)."""
    if size == 0:
        raise ValueError("the batch has 0 samples: there is nothing to split or accumulate; skip empty batches "
                         "(a filtered or exhausted loader can yield one)")


def _balanced(global_batch: int, steps: int) -> list[int]:
    """``global_batch`` in ``steps`` sizes differing by at most one, larger ones first."""
    base, extra = divmod(global_batch, steps)
    return [base + 1] * extra + [base] * (steps - extra)


def split_batch(batch: Any, micro_batch: int, *, balanced: bool = False, min_micro_batch: int = 1) -> list[Any]:
    """Split ``batch`` along dim 0 into micro-batches of at most ``micro_batch`` samples (none
    below ``min_micro_batch``: :func:`micro_batch_sizes`).

    ``batch`` is a tensor or a (nested) tuple, list, named tuple, dict or dataclass of tensors;
    each micro-batch has the same structure. The pieces are views (no copy; a sparse COO
    tensor's are copies). A list or tuple of
    per-sample values as long as the batch (a default-collated list of file names) is split
    with it, as are per-sample dicts, NumPy arrays as long as the batch and the other forms of
    :mod:`~autobatch.planning.samples` (:func:`map_samples`); other non-tensor leaves and 0-dim
    tensors are shared by every micro-batch. See the module docstring for the policy.
    """
    checks.flag("balanced", balanced)  # a string is truthy: balanced="no" cut balanced without a word
    return cut_batch(batch, lambda total: micro_batch_sizes(total, micro_batch, balanced=balanced,
                                                            min_micro_batch=min_micro_batch))


def cut_batch(batch: Any, sizes_of: Callable[[int], list[int]]) -> list[Any]:
    """``batch`` cut along dim 0 into pieces of the sizes ``sizes_of(samples)`` gives (summing to
    its samples), as :func:`split_batch` cuts it: views (a sparse COO tensor's pieces are copies:
    it has no views), per-sample values cut with them."""
    total = batch_size_of(batch)
    check_samples(total)
    sizes = sizes_of(total)
    return [map_samples(batch, lambda t, start=start, size=size: narrow(t, start, size),
                        lambda values, start=start, size=size: values[start:start + size], total)
            for start, size in zip(_offsets(sizes), sizes)]


def accumulate_micro_batches(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    micro_batches: Iterable[Any],
    *,
    global_batch: int,
    autocast: Callable[[], ContextManager] | None = None,
    grad_scaler: "torch.amp.GradScaler | None" = None,
    no_sync: Callable[[], ContextManager] | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> float:
    """Forward and backward every micro-batch, each loss weighted by ``n / global_batch``.

    The core loop behind :func:`accumulate_gradients`; ``micro_batches`` may be lazy (a
    generator that builds each one). Gradients add up in ``param.grad``; the optimizer is
    *not* stepped and gradients are *not* zeroed, so the caller decides both (and may retry
    the whole call after an OOM, having zeroed the gradients). ``no_sync`` (e.g. DDP's
    ``model.no_sync``) wraps every micro-batch but the last, so gradients are all-reduced
    once. No reference to a loss or graph survives an iteration. A sized ``micro_batches``
    (a list, a :class:`LazyMicroBatches`) is read one at a time; an unsized lazy one is read
    one micro-batch ahead (to know which one is last), so two of its micro-batches are alive
    at once: pass a :class:`LazyMicroBatches` when building one allocates device memory.

    ``on_phase(name)``, when given, is called with ``"forward"`` before each micro-batch's
    loss and ``"backward"`` before its backward: the training runner uses it to know where an
    out-of-memory error struck and to inject faults there (:mod:`autobatch.training.oom.faults`).

    Returns the sample-weighted mean loss over the micro-batches (a Python float; one
    device synchronisation at the end).
    """
    total, seen = accumulate_loss_sum(
        model, loss_fn, micro_batches, global_batch=global_batch, autocast=autocast,
        grad_scaler=grad_scaler, no_sync=no_sync, on_phase=on_phase,
    )
    return float(total.item()) / seen


def accumulate_loss_sum(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    micro_batches: Iterable[Any],
    *,
    global_batch: int,
    autocast: Callable[[], ContextManager] | None = None,
    grad_scaler: "torch.amp.GradScaler | None" = None,
    no_sync: Callable[[], ContextManager] | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> tuple[torch.Tensor, int]:
    """:func:`accumulate_micro_batches` without its device synchronisation: returns the sum
    of each micro-batch's mean loss times its size (a 0-dim tensor on the loss's device,
    still being computed) and the number of samples. The data-parallel step reads it after
    it has queued the optimizer step, so the device never idles waiting for the host.
    ``global_batch`` (:func:`check_global_batch`): an integer is checked against the samples
    given; a float (FSDP's mean share per rank) only weights."""
    check_global_batch(global_batch)
    autocast = autocast_factory("autocast", autocast, model) or nullcontext  # a dtype, a torch.autocast(...) too
    checks.grad_scaler("grad_scaler", grad_scaler)
    for name, hook in (("no_sync", no_sync), ("on_phase", on_phase)):  # else "'str' object is not callable" mid-step
        if hook is not None:
            checks.function(name, hook, "no_sync() -> context manager" if name == "no_sync" else "on_phase(name: str)")
    total = None
    seen = 0
    for micro, last in _with_last(micro_batches):
        size = batch_size_of(micro)
        if isinstance(global_batch, numbers.Integral) and seen + size > global_batch:
            raise ValueError(f"global_batch={global_batch} is smaller than the samples given (at least {seen + size}; "
                             "the gradients of the micro-batches before stay accumulated): pass the whole global batch")
        sync = nullcontext() if last or no_sync is None else no_sync()
        with sync:
            if on_phase is not None:
                on_phase("forward")
            with autocast():
                loss = checks.loss("loss_fn", loss_fn(model, micro))  # a model output's .loss; the rest dropped
            del micro  # backward needs what autograd saved, not the inputs (an fp32 image batch
            # under autocast is saved as its bf16 copy: holding the original cost 0.055 GiB at a
            # ResNet-50 micro-batch of 180 on an H200)
            # one piece: the loss itself (x * 1.0 is x), not a second tensor beside it through backward, which the
            # probe's TrainStep step does not hold (on the simulated device a runner at the answer ran out of memory)
            weighted = loss if size == global_batch else loss * (size / global_batch)
            if on_phase is not None:
                on_phase("backward")
            if grad_scaler is not None:
                grad_scaler.scale(weighted).backward()
            else:
                weighted.backward()
        value = loss.detach()
        if value.dtype in (torch.float16, torch.bfloat16):
            value = value.float()  # add up in at least single precision
        value = value * size
        total = value if total is None else total + value
        seen += size
        del loss, weighted, value
    if total is None:
        raise ValueError("no micro-batches to accumulate")
    return total, seen


def accumulate_gradients(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    batch: Any,
    micro_batch: int,
    *,
    global_batch: int | None = None,
    balanced: bool = False,
    autocast: Callable[[], ContextManager] | None = None,
    grad_scaler: "torch.amp.GradScaler | None" = None,
    no_sync: Callable[[], ContextManager] | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> float:
    """Accumulate the gradient of ``batch`` in micro-batches of at most ``micro_batch``.

    ``loss_fn(model, micro)`` returns the mean loss over ``micro``. Each micro-batch's loss is
    weighted by ``len(micro) / global_batch`` (``global_batch`` defaults to the size of
    ``batch``; pass the whole global batch when ``batch`` is only this rank's share), so the
    gradients left in ``param.grad`` equal those of ``loss_fn(model, batch).backward()``.
    Does not step the optimizer or zero gradients; see :func:`accumulate_micro_batches` for
    ``autocast`` (a context factory such as ``TrainStep.autocast``; a ``torch.autocast(...)``, or a dtype
    such as ``torch.float16``, autocast on the model's device: :func:`~autobatch.probe.train_step.autocast_factory`), ``grad_scaler`` and
    ``no_sync`` and ``on_phase``. Returns the mean loss as a float. ``model`` and ``loss_fn`` are
    checked as a :class:`~autobatch.TrainStep` checks them, before any forward.
    """
    check_loop_inputs(model, loss_fn, "accumulate_gradients(model, loss_fn, batch, micro_batch)")
    size = batch_size_of(batch)
    check_samples(size)
    if global_batch is not None:
        check_global_batch(global_batch, given=size, integer=True)
    return accumulate_micro_batches(
        model,
        loss_fn,
        split_batch(batch, micro_batch, balanced=balanced),
        global_batch=size if global_batch is None else global_batch,
        autocast=autocast,
        grad_scaler=grad_scaler,
        no_sync=no_sync,
        on_phase=on_phase,
    )


def accumulated_step(
    step: "TrainStep",
    micro_batches: Iterable[Any],
    *,
    global_batch: int,
    no_sync: Callable[[], ContextManager] | None = None,
    on_phase: Callable[[str], None] | None = None,
    lazy: bool = False,
) -> float | torch.Tensor:
    """One optimizer step of a :class:`~autobatch.TrainStep` over accumulated micro-batches.

    Zeroes gradients, runs :func:`accumulate_micro_batches` with the step's loss, autocast and
    grad scaler, steps the optimizer once (through the scaler when there is one) and zeroes
    gradients again. ``on_phase`` is passed on, and also called with ``"optimizer"`` just
    before the optimizer step. Returns the mean loss: a float, or with ``lazy`` a 0-dim
    tensor still being computed (no device synchronisation: the host can queue the next
    step while the device finishes this one; ``float()`` it when the value is needed).
    """
    check_global_batch(global_batch, integer=True)
    if not isinstance(step, TrainStep):  # else "'Linear' object has no attribute 'optimizer'"
        raise TypeError(f"step must be an autobatch.TrainStep, got {type(step).__name__} {checks.shown(step)}; pass "
                        "TrainStep(model, optimizer, loss_fn, make_batch), or use accumulate_gradients(model, loss_fn, ...)")
    if not isinstance(micro_batches, Iterable) or isinstance(micro_batches, (str, bytes, torch.Tensor)):
        raise TypeError(f"micro_batches must be a list (or iterable) of batches, got {type(micro_batches).__name__} "
                        f"{checks.shown(micro_batches)}; cut one batch into them, e.g. split_batch(batch, micro_batch)")
    checks.flag("lazy", lazy)
    step.begin()  # gradients zeroed; a failed call's unscale_ mark forgotten
    loss = (accumulate_loss_sum if lazy else accumulate_micro_batches)(
        step.model,
        step.loss_fn,
        micro_batches,
        global_batch=global_batch,
        autocast=step.autocast,
        grad_scaler=step.grad_scaler,
        no_sync=no_sync,
        on_phase=on_phase,
    )
    if on_phase is not None:
        on_phase("optimizer")
    step.optimizer_step()
    step.optimizer.zero_grad(set_to_none=True)
    if lazy:
        total, seen = loss
        return total / seen
    return loss


class AccumulatingStep(TrainStep):
    """``step`` as a plan with accumulation trains it: every call is one optimizer step over two
    micro-batches of the size asked for (:func:`accumulated_step`, micro-batches built one at a
    time), so a probe of it measures what a one-batch step never holds: the first micro-batch's
    gradients, alive through the second's forward and backward, where every activation is.
    Measured on the CPU's simulated device (the CLI's MLP, 2 MiB): one-batch trials answered
    323 and the plan 256 x 2 ran out of memory in its second step; the accumulated step fits 244."""

    def __init__(self, step: TrainStep) -> None:
        super().__init__(step.model, step.optimizer, step.loss_fn, step.make_batch, **step.options())

    def __call__(self, batch_size: int) -> None:
        # lazy: no .item(), so an estimate can trace it with fake tensors and a trial queues no sync
        accumulated_step(self, LazyMicroBatches([batch_size, batch_size], self.make_batch), global_batch=2 * batch_size,
                         lazy=True)


class LazyMicroBatches:
    """Micro-batches built one at a time as they are iterated, with a known count.

    ``prepare(piece)`` (e.g. moving a slice of the global batch to the device) runs as each
    micro-batch is reached, never ahead: the device then holds one micro-batch's inputs at a
    time, as a probe trial at that size does. Because the count is known,
    :func:`accumulate_micro_batches` needs no look-ahead to tell the last one.
    """

    def __init__(self, pieces: list[Any], prepare: Callable[[Any], Any]) -> None:
        self.pieces = pieces
        self.prepare = prepare

    def __len__(self) -> int:
        return len(self.pieces)

    def __iter__(self) -> Iterator[Any]:
        for piece in self.pieces:
            yield self.prepare(piece)


# -- helpers ----------------------------------------------------------------------------------
def _offsets(sizes: list[int]) -> list[int]:
    offsets, position = [], 0
    for size in sizes:
        offsets.append(position)
        position += size
    return offsets


def _with_last(values: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """Yield ``(item, is_last)``; looks one item ahead only when ``values`` has no length."""
    if hasattr(values, "__len__"):
        count = len(values)  # type: ignore[arg-type]
        items = iter(values)
        for index in range(count):  # no local keeps the item: the caller frees it when done
            try:
                yield next(items), index == count - 1
            except StopIteration:  # shorter than its length said: stop, as a for loop would
                return
        return
    items = iter(values)
    try:
        current = next(items)
    except StopIteration:
        return
    for following in items:
        yield current, False
        current = following
    yield current, True
