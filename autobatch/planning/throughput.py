"""Candidate plans for a global batch, and timing them in samples per second.

A candidate is (micro-batch, accumulation steps, checkpointing). Timing one runs real global
steps through :func:`~autobatch.planning.accumulation.accumulated_step` (the same loop training uses).
What the measurement does, and why:

* **Warm-up.** ``warmup_steps`` untimed global steps first, so lazy initialisation, kernel
  autotuning and the allocator growing its cache are not timed.
* **Per-step times.** Then ``timed_steps`` global steps, each timed on its own with a device
  synchronisation before each clock reading (``step_seconds`` keeps them all).
* **Median, not minimum.** ``seconds_per_step`` is the median step time, ``samples_per_s``
  is ``global_batch`` over it. The minimum rewards one lucky step; the median is the step
  training will typically see, and a few fast or slow steps do not move it.
* **Clearly slower candidates stop early.** Within a round the candidates run from the largest
  micro-batch down (usually the fastest first), and one whose first :data:`PRUNE_STEPS` timed
  steps each took more than :data:`PRUNE_FACTOR` times the best median so far stops there
  (``pruned``): more steps could not make it a leader. Each, not one: a single slow step (a GC
  pause, a cold cache, another process) ruled out the fastest candidate, and one repeat tells it
  from a slow candidate at the cost of one step more for those pruned. Only in its first round: a
  leader retimed in a later round is not ruled out by slow steps. On the CPU a 512-sample global
  batch in 512 micro-batches of 1 took 6 s a step; its five timed steps ran for half a minute to
  say it was the slowest.
* **Interleaved rounds.** :func:`measure_candidates` can time candidates in rounds
  (A B C A B C ...), each with its own warm-up, so drift (clocks, heat, other load) hits
  them alike; the times of all rounds are pooled. The planner re-times the leaders so.
* **Allocator retries.** On accelerators each candidate starts from an emptied allocator
  cache (so it does not inherit the previous candidate's blocks), and the allocator's retry
  counter (``num_alloc_retries``: an allocation failed, the cache was flushed and the
  allocation retried, a slow path under memory pressure) is read around the timed steps.
  ``alloc_retries`` records the count; a candidate with retries is flagged, and since the
  slow steps are among its timed ones its median carries them.

* **Ranks in lockstep.** Under ``torch.distributed`` (an active
  :class:`~autobatch.probe.ranks.ProbeAgreement`) every step of a candidate is the runner's
  own data-parallel step (DDP's buckets, FSDP2's voted collectives), which fails on every
  rank together; the ranks agree whether each of a candidate's first timed steps is slow enough to
  prune it (the slowest rank's time decides) and then its outcome and step times (each the largest over
  the ranks). So every rank times the same candidates for the same number of steps, enters
  the same collectives, and records the same numbers: the planner picks alike everywhere.

The model and optimizer are put back bit-exactly after every timed candidate
(:class:`~autobatch.probe.snapshot.restore.Snapshot`), so each starts from the same state and the user's
model is untouched afterwards. With a fresh optimizer of a kind that scales every change by its
learning rate (AdamW, SGD, ...) the candidates step at learning rate 0 and no weights are copied
back: the same kernels run, so the times are the same. A candidate that runs out of memory in any round is recorded
with its error and never chosen.

The clock and the retry counter are injectable (``timer``, :class:`DeviceHooks`) so tests
can give steps a known, deterministic cost.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from .. import checks
from .accumulation import LazyMicroBatches, accumulated_step, micro_batch_sizes
from .lockstep import Lockstep
from .plan_arguments import validate_timing
from .plan_result import speed_text
from ..memory.oom import free_memory, is_oom_error
from ..probe.snapshot.restore import Snapshot
from ..probe.snapshot.restore_places import unskipped

__all__ = [
    "Candidate",
    "DeviceHooks",
    "candidate_micro_batches",
    "balanced_micro_batch",
    "measure_candidates",
    "leaders",
    "validate_timing",
]

log = logging.getLogger("autobatch")

#: a candidate whose first :data:`PRUNE_STEPS` timed steps each take more than this many times the best
#: median so far is timed no further (``Candidate.pruned``); a leader is within ``retime_within`` (10 %)
PRUNE_FACTOR = 2.0
#: how many first timed steps must all be that slow to prune: one slow step (a GC pause, a cold cache,
#: another process) ruled out the fastest candidate; a repeat must confirm it. A candidate with no
#: more than this many ``timed_steps`` is timed in full (nothing left to save)
PRUNE_STEPS = 2
#: candidates whose median samples/s is within this fraction of the fastest's are a tie (timing noise
#: cannot order them): the planner picks the fewest accumulation steps among them, then no checkpointing
TIE_WITHIN = 0.01


@dataclass
class Candidate:
    """One way to run the global batch, and what timing it measured.

    ``micro_batch_sizes`` are the sizes of the ``accumulation_steps`` micro-batches (they
    cover the global batch exactly). ``step_seconds`` holds every timed global step of every
    round (``rounds`` of them), ``seconds_per_step`` their median and ``samples_per_s`` the
    global batch over that median. ``alloc_retries`` counts allocator retries during the
    timed steps (None where the device does not report them, e.g. the CPU). ``samples_per_s``
    is None until measured, or when the candidate failed (``error`` says why).
    """

    micro_batch: int
    accumulation_steps: int
    checkpointing: bool
    micro_batch_sizes: list[int]
    samples_per_s: float | None = None
    seconds_per_step: float | None = None
    step_seconds: list[float] = field(default_factory=list)
    rounds: int = 0
    alloc_retries: int | None = None
    error: str | None = None
    chosen: bool = False
    pruned: bool = False  # its first PRUNE_STEPS timed steps each took PRUNE_FACTOR times the best median: no more

    @classmethod
    def build(cls, global_batch: int, micro_batch: int, checkpointing: bool, *, balanced: bool = True) -> "Candidate":
        sizes = micro_batch_sizes(global_batch, micro_batch, balanced=balanced)
        return cls(max(sizes), len(sizes), checkpointing, sizes)

    @property
    def key(self) -> tuple[int, int, bool]:
        return (self.micro_batch, self.accumulation_steps, self.checkpointing)

    @property
    def retried(self) -> bool:
        """True when the allocator had to retry (flush its cache) during the timed steps."""
        return bool(self.alloc_retries)

    def record(self, times: list[float], retries: int | None, global_batch: int) -> None:
        """Add one round's step times (and allocator retries); update the pooled median."""
        self.step_seconds.extend(times)
        self.rounds += 1
        if retries is not None:
            self.alloc_retries = (self.alloc_retries or 0) + retries
        median = statistics.median(self.step_seconds)
        self.seconds_per_step = median
        self.samples_per_s = global_batch / median if median > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON data: an infinite ``samples_per_s`` (a median step of 0 s) is None."""
        return checks.strict_json(asdict(self))


def _noop() -> None:
    return None


@dataclass(frozen=True)
class DeviceHooks:
    """What timing needs from the device: ``synchronize`` before each clock reading,
    ``release_cache`` before each candidate (empty the allocator's cache), and
    ``allocator_retries`` (the allocator's cumulative retry count, or None: not measured).
    The defaults do nothing, as on the CPU."""

    synchronize: Callable[[], None] = _noop
    release_cache: Callable[[], None] = _noop
    allocator_retries: Callable[[], int | None] | None = None

    @classmethod
    def for_device(
        cls, device: torch.device, allocator_retries: Callable[[], int | None] | None = None
    ) -> "DeviceHooks":
        """The hooks for ``device``; ``allocator_retries`` replaces the device's counter
        (the CPU has none)."""
        if device.type == "cpu":
            return cls(allocator_retries=allocator_retries)
        return cls(accelerator_synchronize(device), free_memory, allocator_retries or _retry_counter(device))


def _retry_counter(device: torch.device) -> Callable[[], int | None] | None:
    """Read ``num_alloc_retries`` from the device allocator's statistics; None where the
    backend keeps no such statistics (then retries are not measured)."""
    try:
        if "num_alloc_retries" not in torch.accelerator.memory_stats(device):
            return None
    except (RuntimeError, NotImplementedError, AttributeError):
        return None
    return lambda: torch.accelerator.memory_stats(device).get("num_alloc_retries")


def leaders(candidates: list[Candidate], within: float) -> list[Candidate]:
    """The measured candidates whose samples/s is at least ``1 - within`` of the best's."""
    timed = [c for c in candidates if c.samples_per_s is not None and c.error is None]
    if not timed:
        return []
    best = max(c.samples_per_s for c in timed)
    return [c for c in timed if c.samples_per_s >= (1 - within) * best]


def balanced_micro_batch(global_batch: int, largest: int, multiple_of: int = 1) -> int:
    """The smallest micro-batch that needs no more steps than ``largest`` does:
    ``ceil(global / ceil(global / largest))`` (64 with at most 24 fitting: 3 steps of 22, 21, 21);
    with ``multiple_of`` > 1 (``largest`` one of its multiples) the smallest such multiple, split
    in full pieces and a smaller last one (100 by 2 with 62 fitting: 50 + 50, not 62 + 38)."""
    size = math.ceil(global_batch / math.ceil(global_batch / largest))
    return min(largest, math.ceil(size / multiple_of) * multiple_of)


def candidate_micro_batches(
    global_batch: int, largest: int, *, smallest: int | None = None, multiple_of: int = 1
) -> list[int]:
    """Micro-batch sizes worth timing when at most ``largest`` fits: the powers of two from
    ``smallest`` (default ``largest // 16``, at least 1) up to ``largest``, and ``largest``
    itself; none above ``global_batch``; one per number of accumulation steps, ascending.

    Sizes that need the same number of steps do the same number of micro-steps, so only the
    smallest such size (:func:`balanced_micro_batch`, the least padding) is kept. With
    ``multiple_of`` > 1 every size is rounded down to a multiple of it (at least one), the smallest
    multiple per step count (a balanced split would break the multiple: these are split in full
    pieces, a smaller last). Rounded, not filtered: no power of two is a multiple of 3, and
    ``multiple_of=3`` timed the largest alone (960 with 48 fitting: 48 x 20, no other candidate).
    """
    largest = min(largest, global_batch)
    low = max(1, largest // 16) if smallest is None else max(1, smallest)
    sizes = {largest}
    power = 1
    while power <= largest:
        if power >= low:
            sizes.add(power)
        power *= 2
    if multiple_of > 1:  # largest is a multiple already
        sizes = {max(multiple_of, size // multiple_of * multiple_of) for size in sizes}
    by_steps: dict[int, int] = {}
    for size in sorted(sizes):
        steps = math.ceil(global_batch / size)
        by_steps[steps] = balanced_micro_batch(global_batch, size, multiple_of)
    return sorted(set(by_steps.values()))


def measure_candidates(
    step: Any,
    candidates: list[Candidate],
    *,
    global_batch: int,
    warmup_steps: int = 1,
    timed_steps: int = 5,
    rounds: int = 1,
    timer: Callable[[], float],
    hooks: DeviceHooks = DeviceHooks(),
    prepare: Callable[[Candidate], None] | None = None,
) -> None:
    """Time the candidates in ``rounds`` interleaved rounds (A B C A B C ...), in place.

    Each round gives each candidate ``warmup_steps`` untimed and ``timed_steps`` timed global
    steps, added to what earlier calls recorded (:meth:`Candidate.record`: the median is over
    all of them). ``step`` is a :class:`~autobatch.TrainStep`; its ``make_batch`` builds each
    micro-batch. ``prepare(candidate)`` puts the model in the candidate's checkpointing
    state; without it the model must already be in it. Model, optimizer and grad scaler are restored
    after each candidate; a candidate that runs out of memory gets ``error`` and
    ``samples_per_s = None`` and is skipped in later rounds.
    """
    knobs = validate_timing(warmup_steps=warmup_steps, timed_steps=timed_steps)
    warmup_steps, timed_steps = knobs["warmup_steps"], knobs["timed_steps"]
    agreed = Lockstep.of(step)  # None in one process
    # a fresh optimizer steps at learning rate 0 instead: no copy of the weights to put back
    # after every candidate (the same kernels run, so the timing is the same)
    # the grad scaler too: every candidate starts from the user's scale, and plan() leaves it so
    # (the timed steps grew it, 1024 to 131072 over a few candidates)
    snapshot = Snapshot.take(step.model, step.optimizer, zero_lr=True, scaler=getattr(step, "grad_scaler", None))
    try:
        for _ in range(rounds):
            for candidate in sorted(candidates, key=lambda c: -c.micro_batch):  # the likely fastest first
                if candidate.error is not None or candidate.pruned:
                    continue
                if prepare is not None:
                    prepare(candidate)
                hooks.release_cache()
                best = min((c.seconds_per_step for c in candidates if c.seconds_per_step and c.error is None),
                           default=None)
                bound = None if best is None else PRUNE_FACTOR * best
                # at scale 1, as the probe's trials: from a large scale (init_scale=2**40) every timed step overflowed
                # and skipped its optimizer step, so the timing held neither that step nor its state
                unskipped([getattr(step, "grad_scaler", None)])
                error = _time(step, candidate, global_batch, warmup_steps, timed_steps, timer, hooks, bound, agreed)
                if error is not None:
                    step.clear_grads()
                    free_memory()
                    candidate.error = error
                    candidate.samples_per_s = None
                    log.info("candidate %s ran out of memory while timed: %s", candidate.key, error)
                snapshot.restore(keep=True)
    finally:
        snapshot.restore()


def _time(step, candidate, global_batch, warmup_steps, timed_steps, timer, hooks, bound=None, agreed=None) -> str | None:
    """Run and time the candidate once; return None, or the OOM's first line. The clock is read
    exactly twice per timed step: right before and after it. First timed steps over ``bound``
    seconds, :data:`PRUNE_STEPS` in a row, end the timing (``candidate.pruned``; :func:`_pruned`).
    ``agreed`` (a :class:`~autobatch.planning.lockstep.Lockstep`): the ranks step together and agree
    the pruning (every rank at the same sync points, failed or not) and the outcome."""

    def one_step() -> None:
        if agreed is not None:
            agreed.run(candidate.micro_batch_sizes)
            return
        # built one at a time as reached, as the probe and the runner do (no look-ahead)
        accumulated_step(step, LazyMicroBatches(candidate.micro_batch_sizes, step.make_batch), global_batch=global_batch)

    times: list[float] = []
    counts: list[int | None] = []  # the allocator's retry count after the warm-up, and at the end

    def run(steps: int, warm: bool = False) -> str | None:
        """The warm-up (``warm``) and ``steps`` timed steps; None or the OOM's line."""
        try:
            if warm:
                for _ in range(warmup_steps):
                    one_step()
                hooks.synchronize()
                counts.append(hooks.allocator_retries() if hooks.allocator_retries else None)
            for _ in range(steps):
                began = timer()
                one_step()
                hooks.synchronize()
                times.append(timer() - began)
        except BaseException as exc:  # noqa: BLE001 - re-raised unless it is an OOM
            if not is_oom_error(exc):
                raise
            text = str(exc).strip()
            return text.splitlines()[0][:300] if text else type(exc).__name__
        return None

    failure = run(1, warm=True)
    peers_failed = False
    # only in a candidate's first round: a leader retimed is not ruled out by slow steps (a spike
    # of other load), and its pooled median keeps the first round's steps
    if bound is not None and candidate.rounds == 0 and timed_steps > PRUNE_STEPS:
        failure, peers_failed = _pruned(candidate, times, failure, bound, run, agreed)
    if failure is None and not peers_failed and not candidate.pruned and len(times) < timed_steps:
        failure = run(timed_steps - len(times))
    counts.append(hooks.allocator_retries() if hooks.allocator_retries else None)
    retries = None if None in counts or len(counts) < 2 else counts[-1] - counts[0]
    if agreed is not None:
        failure, times, retries = agreed.outcome(candidate, failure, times, retries, timed_steps)
    if failure is not None:
        return failure
    candidate.record(times, retries, global_batch)
    log.info(
        "candidate micro=%d x %d checkpointing=%s: round %d, median %s%s",
        candidate.micro_batch,
        candidate.accumulation_steps,
        candidate.checkpointing,
        candidate.rounds,
        speed_text(candidate.samples_per_s),
        (f", {retries} allocator retries" if retries else "")
        + (f", pruned after {len(times)} steps" if candidate.pruned else ""),
    )
    return None


def _pruned(candidate, times, failure, bound, run, agreed) -> tuple[str | None, bool]:
    """Decide whether the candidate's first timed steps rule it out: it is pruned (``candidate.pruned``)
    where each of its first :data:`PRUNE_STEPS` steps took more than ``bound``, timing one more
    while the ones so far all did; the first step within the bound ends the check (the caller times
    the rest). A single slow step, a GC pause or a cold cache, pruned the fastest candidate. Under
    ``agreed`` every rank checks each step at the same sync point (the slowest rank's time decides).
    Returns the failure so far and whether a peer failed (then every rank goes on to the outcome)."""
    for index in range(PRUNE_STEPS):
        if failure is not None and agreed is None:
            break
        seconds = times[index] if failure is None else 0.0
        slowest = seconds if agreed is None else agreed.slowest(failure, seconds, candidate, index)
        if slowest is None:
            return failure, True
        if slowest <= bound:
            break
        if index + 1 == PRUNE_STEPS:
            candidate.pruned = True
        else:
            failure = run(1)
    return failure, False


def accelerator_synchronize(device: torch.device) -> Callable[[], None]:
    """A synchronise function for ``device`` (a no-op on the CPU)."""
    if device.type == "cpu":
        return _noop
    return lambda: torch.accelerator.synchronize(device)
