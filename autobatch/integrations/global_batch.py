"""Keep a global batch with the largest batch that fits: the accumulation the integrations set."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Split", "accumulation_for", "cap_at_samples", "changed_samples", "check_share", "small_split", "split_keeping"]


def accumulation_for(share: int, largest: int, *, multiple_of: int = 1) -> tuple[int, int]:
    """``(k, b)``: the fewest micro-batches ``k`` with ``b <= largest`` and ``b * k == share``
    exactly (``share``: this rank's samples per optimizer step), ``b`` a multiple of
    ``multiple_of`` (a batch size the kernels or the hardware prefer, as ``find_max_batch``'s
    option). ``b`` may be below ``largest`` where ``share`` has no divisor closer to it; with
    ``multiple_of=1`` batch 1 always divides."""
    for name, value in (("share", share), ("largest", largest), ("multiple_of", multiple_of)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    for k in range(-(-share // largest), share + 1):
        if share % k == 0 and (share // k) % multiple_of == 0:
            return k, share // k
    raise ValueError(
        f"no micro-batch of at most {largest} samples that is a multiple of multiple_of={multiple_of} divides "
        f"{share} samples per step; use a share that is a multiple of {multiple_of} and a largest batch of at "
        f"least {multiple_of}, or a smaller multiple_of"
    )


class Split(NamedTuple):
    """The split :func:`split_keeping` chose: ``accumulation`` micro-batches of ``size``;
    ``warning``: why the user's own accumulation was replaced (None: it was kept, or none given);
    ``fewer``: the accumulation that would fit, where the user's kept one is larger (else None)."""

    accumulation: int
    size: int
    warning: str | None = None
    fewer: int | None = None


def split_keeping(global_batch: int, world: int, largest: int, given: int | None, *, multiple_of: int = 1,
                  setting: str, where: str, unit: str = "rank", probed: int | None = None) -> Split:
    """The split of a process's share of ``global_batch`` that keeps the user's own accumulation
    ``given`` (``setting``, e.g. ``accumulate_grad_batches``, set on ``where``) where it can.

    Why: a user who set both ``global_batch`` and an accumulation had it replaced by the fewest
    micro-batches that fit, with one INFO line. Where ``given`` splits the share exactly into
    micro-batches that fit (at most ``largest``, a multiple of ``multiple_of``), it is kept, as the
    user asked (``fewer`` says how many would do). Otherwise the fewest micro-batches that fit are
    set, with a warning naming both values and what to change. ``given`` of None or 1 (the
    frameworks' default) leaves the choice to :func:`accumulation_for`. ``probed``: the probe's
    largest micro-batch, named in the warning (default ``largest``; a confirmation may have
    passed ``largest`` below it)."""
    share = global_batch // world
    accumulation, size = accumulation_for(share, largest, multiple_of=multiple_of)
    if given is None or given <= 1 or given == accumulation:
        return Split(accumulation, size)
    exact = share % given == 0 and (share // given) % multiple_of == 0  # equal micro-batches, each a multiple
    if exact and share // given <= largest:
        return Split(given, share // given, fewer=accumulation if accumulation < given else None)
    ranks = f" of each of {world} {unit}{'es' if unit.endswith('s') else 's'}" if world > 1 else ""
    if not exact:
        multiple = f" that are multiples of multiple_of={multiple_of}" if multiple_of > 1 else ""
        why = f"does not split the {share} samples per optimizer step{ranks} into equal micro-batches{multiple}"
    else:
        why = f"would train micro-batches of {share // given}, more than fit (the probe's largest: {probed or largest})"
    fitting = max(multiple_of, largest - largest % multiple_of)  # not the replacement's size: "at most 8" where 10 fit
    return Split(accumulation, size, warning=(
        f"{setting}={given} (set on {where}) {why}; global_batch={global_batch} is kept with {setting}={accumulation} "
        f"(micro-batches of {size}) instead. Remove {setting} from {where} (global_batch sets it), or pass a "
        f"global_batch that {setting}={given} splits into micro-batches of at most {fitting} "
        f"(e.g. global_batch={given * fitting * world})"))


def check_share(global_batch: int, world: int, multiple_of: int, *, unit: str = "rank") -> int:
    """Each of ``world`` ``unit``'s share of ``global_batch`` (samples per optimizer step), or
    one ``ValueError`` where the ranks cannot split it evenly, or no batch that is a multiple of
    ``multiple_of`` divides a share (checked before any probe: no answer could keep it)."""
    suffix = "es" if unit.endswith("s") else "s"
    if global_batch % world:
        raise ValueError(f"global_batch={global_batch} does not split over {world} {unit}{suffix}; use a multiple")
    share = global_batch // world
    if share % multiple_of:
        raise ValueError(
            f"global_batch={global_batch} gives each of {world} {unit}({suffix}) {share} samples per optimizer step, which "
            f"no batch that is a multiple of multiple_of={multiple_of} divides; use a global_batch that is a multiple "
            f"of {multiple_of * world}"
        )
    return share


def cap_at_samples(samples: int | None, max_batch: int | None, start: int | None, multiple_of: int, *,
                   where: str) -> tuple[int | None, int | None]:
    """``(max_batch, start)`` capped at ``samples`` (a process's share of the training set or of
    ``global_batch``; None: no cap): no batch larger can train. Why here, not by passing the cap on
    as ``max_batch``: ``find_max_batch`` then refused a set smaller than ``multiple_of``, or a
    ``start`` above the set, naming ``max_batch``, an option the user never set. A set smaller than
    ``multiple_of`` is one ``ValueError`` naming ``where``; a ``start`` above the cap starts at it."""
    if samples is None:
        return max_batch, start
    if samples < multiple_of:
        raise ValueError(
            f"{where} has {samples} samples, fewer than multiple_of={multiple_of}: no batch that is a multiple of "
            f"{multiple_of} fits in it; lower multiple_of or use more samples"
        )
    return (samples if max_batch is None else min(max_batch, samples)), (None if start is None else min(start, samples))


def small_split(global_batch: int, world: int, largest: int, size: int, *, multiple_of: int = 1,
                unit: str = "rank") -> str | None:
    """A warning where :func:`accumulation_for` split each ``unit``'s share of ``global_batch`` into
    micro-batches of ``size``, under half the ``largest`` that fits (None otherwise), naming the
    nearest global batches below and above whose split keeps at least half.

    Why: the split must be exact, so a share with no divisor near the largest took the next one
    down, silently: ``global_batch=998`` where 403 fit trained 499 micro-batches of 2 a step (a
    prime one, micro-batches of 1), each step as many forward and backward passes where 3 would
    do; 1,000 trains 4 of 250."""
    share = global_batch // world
    best = largest // multiple_of * multiple_of if largest >= multiple_of else largest
    if size < 1 or 2 * size >= best:
        return None
    below = next((other for other in range(share - 1, 0, -1) if _splits_well(other, best, multiple_of)), None)
    above = next(other for other in range(share + 1, 2 * share + best) if _splits_well(other, best, multiple_of))
    near = " or ".join(f"{other * world} ({_split(other, best, multiple_of)})" for other in (below, above) if other)
    return (
        f"global_batch={global_batch} splits into {share // size} micro-batches of {size} per {unit} (a share of "
        f"{share}), under half the {best} that fit{'' if multiple_of == 1 else f' (a multiple of {multiple_of})'}: "
        f"the split must be exact and {share} has no divisor closer to {best}, so each optimizer step runs "
        f"{share // size} forward and backward passes where {-(-share // best)} would do; a global_batch of {near} "
        "keeps the micro-batches large"
    )


def _splits_well(share: int, best: int, multiple_of: int) -> bool:
    """Whether ``share`` splits exactly into micro-batches of at least half of ``best`` (at most
    ``best``), each a multiple of ``multiple_of``."""
    return any(share % count == 0 and (share // count) % multiple_of == 0
               for count in range(-(-share // best), share * 2 // best + 1))


def _split(share: int, best: int, multiple_of: int) -> str:
    count, size = accumulation_for(share, best, multiple_of=multiple_of)
    return f"{count} x {size}"


def changed_samples(before: int, after: int, accumulation: int, world: int, *, size_setting: str, setting: str,
                    where: str, samples: int | None = None, multiple_of: int = 1) -> str | None:
    """A warning where the size set, ``after``, changes the samples per optimizer step that the
    user's own accumulation made with their size ``before`` (None where it does not, or where the
    accumulation is 1: the batch alone is the step, and finding it is what was asked).

    Why: with no ``global_batch``, the user's ``gradient_accumulation_steps`` (or
    ``accumulate_grad_batches``) is kept and the per-device batch replaced, so ``per_device 16 x 4``
    became ``3 x 4``: 12 samples a step where the learning rate and schedule were tuned for 64, with
    only an INFO line, which a script does not show (Transformers' ``auto_find_batch_size`` changes
    it the same way, silently: transformers#33281). An accumulation above 1 says the user built a
    global batch, so the change is said, naming ``global_batch=`` to keep it. ``samples``: a
    process's samples of the training set (None: unknown); a ``global_batch`` whose share is larger
    is refused (an epoch would end first), so where the old samples a step are more than the set
    holds, the warning names the largest ``global_batch`` that is taken (a multiple of ``world``
    times ``multiple_of``) instead of one that is refused."""
    if accumulation <= 1 or before == after or not isinstance(before, int) or isinstance(before, bool):
        return None
    ranks = f" over {world} processes" if world > 1 else ""
    old, new = before * accumulation * world, after * accumulation * world
    keep = (f"pass global_batch={old} to keep {old} samples a step (the accumulation is then set so its micro-batches "
            "fit)")
    if samples is not None and old // world > samples:  # refused: each epoch would end before one global batch
        largest = samples // multiple_of * multiple_of * world
        keep = (f"global_batch={old} would be refused, as the training set holds {samples * world} samples, fewer "
                f"than a step of {old}; " + (f"pass global_batch={largest} or less to fix the samples a step (the "
                                             "accumulation is then set so its micro-batches fit)" if largest else
                                             "use more training samples"))
    return (f"{size_setting}={after} with {setting}={accumulation} (set on {where}) trains {new} samples per optimizer "
            f"step{ranks} where {size_setting}={before} trained {old}, so the learning rate and schedule tuned for {old} "
            f"no longer match; {keep}, or set {setting}=1 to train the probe's batch alone")
