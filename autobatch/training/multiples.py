"""Micro-batches that are multiples of ``multiple_of``: the runner's split, shrink and growth in steps of N.

A run planned with ``multiple_of=8`` (tensor cores), or a model that needs an even batch
(contrastive pairs) or one divisible by its number of groups, must train only such micro-batches,
after an out-of-memory recovery and a grow-back too, not only at its start. ``Runner(multiple_of=N)``
(or ``plan_options={"multiple_of": N}``, which the runner adopts: one setting, planned and trained)
makes every micro-batch it trains a multiple of N:

* the split: full pieces of the micro-batch and a smaller last one, a multiple because the batch
  per rank is one (checked when the runner is made); where that last piece would fall below
  ``min_micro_batch``, the batch is cut into fewer pieces balanced in steps of N, as
  :func:`~autobatch.micro_batch_sizes` cuts it in steps of one sample;
* a recovery rounds its smaller micro-batch (measured or halved) down to a multiple, never below
  the floor; grow-back rounds its ceiling down to one (never above the batch per rank);
* the floor is ``min_micro_batch`` rounded *up* to a multiple, at least N: "no piece below 6, every
  piece a multiple of 4" is "no piece below 8", so the rounding is what both settings say together,
  and N itself is the smallest size a recovery tries before the checkpointing fallback or giving up.

A batch that is no multiple of N (a DataLoader's short last batch) cannot be cut into multiples: it
trains with one piece that is not one (warned once by the runner; ``drop_last=True`` avoids it),
rather than a whole epoch's progress being lost to an error at its end.

A resume keeps *this* run's ``multiple_of``, as it keeps every setting of its constructor: the
checkpoint's micro-batch is rounded down to it (a warning says where the checkpoint's run had
another; a checkpoint of an older version, which has none, counts as ``multiple_of=1``).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping

from .. import checks
from ..errors import add_note
from ..planning.accumulation import LazyMicroBatches, batch_size_of, check_samples, cut_batch, micro_batch_sizes
from .inputs import check_batch_count, check_split
from .pacing import FailedDraw, carried_error

__all__ = ["SplitsInMultiples", "multiple_options", "multiple_sizes", "resumed_micro_batch", "round_down"]

log = logging.getLogger("autobatch")


def round_down(size: int, multiple_of: int) -> int:
    """``size`` rounded down to a multiple of ``multiple_of``, at least ``multiple_of`` itself."""
    return max(multiple_of, size // multiple_of * multiple_of)


def multiple_options(multiple_of: Any, plan_options: dict[str, Any], *, share: int, micro_batch: int | None,
                     max_micro_batch: int | None, min_micro_batch: int, balanced: bool,
                     per_rank: bool) -> tuple[int, bool, int]:
    """``Runner(multiple_of=)`` checked against its other sizes: ``(multiple_of, balanced, floor)``.

    ``multiple_of`` is a positive integer; a different one in ``plan_options`` is one error, an equal
    one (or ``multiple_of=1``, the default) adopts it, and a runner's own N > 1 is added to
    ``plan_options`` (mutated) so that the planner probes only multiples. The batch per rank
    (``share``) and a ``micro_batch`` given must be multiples; ``balanced`` is off with N > 1 (balanced
    sizes would not be multiples); the floor is ``min_micro_batch`` rounded up to a multiple, and it
    must leave the batch a split and ``max_micro_batch`` a multiple at or above it. One ``ValueError``
    naming what to change otherwise."""
    from .oom.recovery import checked_min_micro_batch

    multiple_of = checks.positive_int("multiple_of", multiple_of)
    planned = plan_options.get("multiple_of")
    if planned is not None:
        planned = checks.positive_int("plan_options['multiple_of']", planned)
        if multiple_of > 1 and planned > 1 and planned != multiple_of:
            raise ValueError(f"multiple_of={multiple_of} and plan_options['multiple_of']={planned} differ: the runner "
                             "trains the multiples it plans; give one of them (or the same value in both)")
        multiple_of = max(multiple_of, planned)
    if multiple_of > 1:
        plan_options["multiple_of"] = multiple_of
    if share % multiple_of:
        from ..planning.plan_arguments import divisors_text  # a prime share: only 1 divides it, as plan() says

        below = share // multiple_of * multiple_of
        where = f"global_batch={share}" if not per_rank else f"the global batch per rank ({share})"
        nearest = f"{below} or {below + multiple_of}" if below else str(multiple_of)
        raise ValueError(f"{where} is not a multiple of multiple_of={multiple_of}, so its micro-batches cannot all be "
                         f"multiples; use a global batch{' per rank' if per_rank else ''} of {nearest}, or a multiple_of "
                         f"that divides {share}{divisors_text(share, multiple_of)}")
    if micro_batch is not None and micro_batch % multiple_of:
        below = micro_batch // multiple_of * multiple_of
        raise ValueError(f"micro_batch={micro_batch} is not a multiple of multiple_of={multiple_of}; use "
                         f"{f'{below} or ' if below else ''}{below + multiple_of}")
    if max_micro_batch is not None and max_micro_batch < multiple_of:  # a larger one is rounded down (a ceiling)
        raise ValueError(f"max_micro_batch={max_micro_batch} is below multiple_of={multiple_of}: grow-back could never "
                         f"reach a multiple; raise max_micro_batch to at least {multiple_of}, or leave it unset")
    if micro_batch is not None and max_micro_batch is not None and micro_batch > max_micro_batch:
        raise ValueError(f"micro_batch={micro_batch} is above max_micro_batch={max_micro_batch}, the largest micro-batch "
                         f"the run may grow to: it would train above it from the start; lower micro_batch to at most "
                         f"{max_micro_batch}, or raise max_micro_batch")
    floor = checked_min_micro_batch(min_micro_batch, micro_batch, max_micro_batch, share)
    if multiple_of == 1:
        check_split(share, floor, balanced, per_rank=per_rank)
        return 1, balanced, floor
    floor = math.ceil(floor / multiple_of) * multiple_of
    ceiling = None if max_micro_batch is None else round_down(min(max_micro_batch, share), multiple_of)
    if ceiling is not None and floor > ceiling:
        raise ValueError(f"min_micro_batch={min_micro_batch} rounds up to {floor} with multiple_of={multiple_of}, above "
                         f"max_micro_batch={max_micro_batch} (a multiple: {ceiling}); lower min_micro_batch to at most "
                         f"{ceiling} or raise max_micro_batch")
    try:
        multiple_sizes(share, floor, multiple_of, floor)
    except ValueError:
        raise ValueError(
            f"global_batch={share}{' per rank' if per_rank else ''} cannot be cut into micro-batches that are multiples "
            f"of multiple_of={multiple_of} and at least min_micro_batch={min_micro_batch} (rounded up: {floor}), as a "
            f"recovery that shrinks the micro-batch to {floor} must ({share // floor} of {floor} leave "
            f"{share % floor} over); lower min_micro_batch, or use a global batch that is a multiple of {floor}"
        ) from None
    return multiple_of, False, floor


def multiple_sizes(total: int, micro_batch: int, multiple_of: int, floor: int) -> list[int]:
    """The sizes a batch of ``total`` samples is cut into at ``micro_batch``, all multiples of
    ``multiple_of`` (``micro_batch`` and ``floor`` are): full pieces and a smaller last one; where the
    last would fall below ``floor``, fewer pieces balanced in steps of N (at most N over the
    micro-batch). A ``total`` that is no multiple puts its remainder on the last piece where it
    stays within the micro-batch, else in a piece of its own (the one piece that is no multiple).
    ``ValueError`` where no such cut exists (:func:`~autobatch.micro_batch_sizes`'s, in steps of N)."""
    whole, rest = divmod(total, multiple_of)
    if not whole:
        return [total]
    units = micro_batch_sizes(whole, max(1, micro_batch // multiple_of), min_micro_batch=max(1, floor // multiple_of))
    sizes = [unit * multiple_of for unit in units]
    if rest and sizes[-1] + rest <= micro_batch:
        sizes[-1] += rest
    elif rest:
        sizes.append(rest)
    return sizes


def resumed_micro_batch(state: Mapping[str, Any], multiple_of: int, floor: int, share: int) -> int:
    """The micro-batch a resumed run starts with: the checkpoint's, at least this run's ``floor``,
    at most its batch per rank (``share``; the caller passes its ceiling where lower:
    ``max_micro_batch``, else a given ``micro_batch``), and rounded down to *this* run's
    ``multiple_of`` (its setting wins, as every setting of the resumed run's constructor does). A checkpoint written
    with another multiple (an older one has none: 1) is warned about, not refused: training on is
    still exact, and a deliberate change (another device) resumes."""
    saved = int(state.get("multiple_of", 1))
    if saved != multiple_of:
        log.warning("resume: the checkpoint's run kept its micro-batches multiples of %d, this run keeps them multiples "
                    "of %d (Runner(multiple_of=), or plan_options['multiple_of']); pass multiple_of=%d to keep the "
                    "checkpoint's", saved, multiple_of, saved)
    return round_down(min(max(state["micro_batch"], floor), share), multiple_of)


class SplitsInMultiples:
    """The split of a :class:`~autobatch.Runner` (which sets the attributes): its batch cut at its
    micro-batch, every piece a multiple of ``multiple_of`` (:func:`multiple_sizes`), or with
    ``multiple_of=1`` the ``balanced`` split of :func:`~autobatch.micro_batch_sizes`, none below
    ``min_micro_batch`` (15 by 2 is ``3, 2, ...``, not ``..., 2, 1``)."""

    multiple_of = 1
    share: int  # the rank's batch (the global batch in one process)
    distributed: bool = False

    def _micro_batches(self, batch: Any) -> LazyMicroBatches:
        """``batch`` cut into the current micro-batches, each moved to the device only when read
        (no look-ahead: the device holds one micro-batch's inputs, as a probe trial does). A
        batch this rank failed to draw raises its error as the first one is read, inside the
        step, whose vote stops every rank (:mod:`~autobatch.training.pacing`). The first split that
        differs from the run's first one checks the loss (:mod:`~autobatch.training.split_warnings`)."""
        self._check_loss_split()  # type: ignore[attr-defined]
        pieces = batch if isinstance(batch, FailedDraw) else carried_error(
            lambda: cut_batch(batch, self._piece_sizes), self.distributed)  # an uncuttable batch: the same
        if isinstance(pieces, FailedDraw):
            return LazyMicroBatches([pieces], pieces.reraise)
        return LazyMicroBatches(pieces, self._transfer)

    def _sized(self, batch: Any) -> Any:
        """``batch``, once its size is readable and not 0 and, where it is not the rank's share, its
        samples are counted alike (per-sample items, ``collate_fn=list``, are no short batch). Its
        error names the batch's place in the data (found at step 40,000, it is no use otherwise)."""
        try:
            size = batch_size_of(batch)
            check_samples(size)  # an empty batch: nothing to split or accumulate
            if size != self.share:
                check_batch_count(batch, size, self.share)
        except (TypeError, ValueError) as exc:
            place = f"the data's batch {self.position + 1} of epoch {self.epoch + 1} (step {self.step})"  # type: ignore[attr-defined]
            note = getattr(self, "_unbatched_note", None)  # a DataLoader(batch_size=None) of an IterableDataset
            if note is not None:
                add_note(exc, note)
            add_note(exc, f"raised reading {place}" + (
                ": the data yielded None there, as a collate_fn or dataset that returns None for samples it filters "
                "out does; leave such batches out of the data (or keep at least one sample in each)" if batch is None else ""))
            raise
        return batch

    def piece_sizes(self, total: int | None = None) -> list[int]:
        """The micro-batch sizes a batch of ``total`` samples (default: the last step's) is cut into
        at the current micro-batch: what a step trains, where ``micro_batch x steps`` is only its bound
        (20 samples at micro-batch 7 train as 7, 7, 6)."""
        return self._piece_sizes(total)

    def _piece_sizes(self, total: int | None = None) -> list[int]:
        """The sizes a batch of ``total`` samples (default: the current one's) is cut into at the
        current micro-batch."""
        total = self._local_size if total is None else total
        if self.multiple_of > 1:
            return multiple_sizes(total, self.micro_batch, self.multiple_of, self.min_micro_batch)
        return micro_batch_sizes(total, self.micro_batch, balanced=self.balanced, min_micro_batch=self.min_micro_batch)
