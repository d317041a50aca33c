"""What :class:`~autobatch.integrations.lightning.AutoBatchSize` says when a resumed ``fit`` does
not train the split its checkpoint asked for.

A checkpoint of the callback holds the size, the accumulation, ``global_batch`` and the world size
it trained at (``AutoBatchSize.state_dict``). A fit resumed with the same ``global_batch`` and world
size trains at that split again without a new search, so each optimizer step trains as many samples,
at the same batch size, as the run it resumes. Two ways a user's run then differs from what they
see in their script, each said in one warning (both were one INFO line):

* :func:`overridden_accumulation`: the resumed run's ``Trainer(accumulate_grad_batches=8)`` is
  replaced with the checkpoint's 2 (512 x 2 = 1024 a step): the user's own setting was dropped;
* :func:`changed_samples`: a checkpoint trained at ``global_batch=1024`` (512 x 2) resumed with
  ``AutoBatchSize()`` probes again and trains 795 x 1: the samples per optimizer step (and with
  them the learning rate's meaning) change mid-run.

A ``max_batch`` lowered on resume below the checkpoint's batch size holds (:func:`resumed_split`):
the checkpoint's samples per optimizer step are split into micro-batches of at most ``max_batch``,
with one warning. Why: the checkpoint's size won, so a user who lowered the cap (a smaller device,
a run that ran out of memory) trained at the size they had just excluded, with only an INFO line.
The same where this machine has less memory than the run that wrote the checkpoint: its size is
checked with one trial, ``margin`` kept, and a run of the fit loop (:func:`~.lightning_trials.kept_fits`)
and, where it does not fit, split
into micro-batches of at most the size the search finds below it, said in the same warning.
"""

from __future__ import annotations

from typing import Any, Mapping

from lightning.pytorch.utilities import rank_zero_warn

from .global_batch import split_keeping
from .lightning_tuners import tell

__all__ = ["changed_samples", "dropped_samples", "overridden_accumulation", "restored_note", "resumed_split"]


def resumed_split(restored: Mapping[str, Any], given: int | None, global_batch: int | None, world: int,
                  options: Mapping[str, Any], name: str, state_key: str,
                  fits: int | None = None, manual: bool = False) -> tuple[int, int | None]:
    """The size and accumulation a resumed run trains at, from a checkpoint of the same ``global_batch``
    and ``world`` size: the checkpoint's (:func:`overridden_accumulation`, :func:`restored_note`), or,
    where the probe ``options``' ``max_batch``, or ``fits`` (the largest batch that trains on this
    machine: :func:`~.lightning_trials.kept_fits`), is below its size, its samples per optimizer step split
    into micro-batches of at most that (the Trainer's ``given`` accumulation kept where it
    splits ``global_batch`` so; without ``global_batch``, the checkpoint's size times ``given``),
    said in one warning. Under ``manual`` optimization Lightning accumulates nothing (it refuses
    ``accumulate_grad_batches`` above 1 there, before ``on_fit_start``): the run trains at the largest
    size allowed, its smaller samples per step said (:func:`_manual_split`)."""
    size, cap, multiple = restored["batch_size"], options["max_batch"], options["multiple_of"]
    cause = f"max_batch={cap} is below"
    if fits is not None and fits < min(size, cap or size):
        cap, cause = fits, f"this machine's memory fits batches up to {fits} (probed), below"
    if cap is None or size <= cap:
        overridden_accumulation(restored, given, state_key)  # warned
        restored_note(name, size, restored["accumulation"])
        return size, restored["accumulation"]
    if manual:
        return _manual_split(size, cap, multiple, world, name, cause), None
    accumulation = restored.get("accumulation") or given or 1
    share, ranks = size * accumulation, f" x {world} ranks" if world > 1 else ""  # a rank's samples per step
    if share % multiple:
        raise ValueError(
            f"AutoBatchSize: {cause} the checkpoint's {name}={size}, and its {share} samples per "
            f"optimizer step{' per rank' if ranks else ''} ({size} x accumulate_grad_batches={accumulation}) do not "
            f"split into micro-batches that are multiples of multiple_of={multiple}; pass a multiple_of that divides "
            f"{share}{f', or max_batch={size} or more' if cause.startswith('max') else ''}")
    split = split_keeping(share * world, world, cap, given if global_batch else None, multiple_of=multiple,
                          setting="accumulate_grad_batches", where="the Trainer")
    replaced = "" if global_batch else f" (the Trainer's accumulate_grad_batches={given or 1} replaced)"
    rank_zero_warn(
        f"AutoBatchSize: {cause} the checkpoint's {name}={size}: this resumed run trains {split.size} x "
        f"accumulate_grad_batches={split.accumulation}{ranks}{replaced}, the checkpoint's {share * world} samples per "
        f"optimizer step ({size} x {accumulation}{ranks}) at a smaller batch. From a mid-epoch checkpoint the first step "
        "may train fewer (Lightning counts its window from the batches trained already): resume from an end-of-epoch one")
    if split.warning:
        rank_zero_warn(f"AutoBatchSize: {split.warning}")
    return split.size, split.accumulation


def _manual_split(size: int, cap: int, multiple: int, world: int, name: str, cause: str) -> int:
    """The size a resumed manual-optimization run trains at where its checkpoint's ``size`` is above
    ``cap``: the largest multiple of ``multiple`` up to it, with one warning. Why not a split: Lightning
    runs no automatic accumulation under manual optimization, so an ``accumulate_grad_batches`` set by the
    callback (after Lightning's check) was ignored: a GAN resumed under less memory trained 211 samples
    per optimizer step while the warning said it kept the checkpoint's 422 (211 x 2)."""
    micro = max(multiple, cap // multiple * multiple)
    by_hand = split_keeping(size * world, world, cap, None, multiple_of=multiple, setting="accumulate_grad_batches",
                            where="the Trainer") if size % multiple == 0 else None
    hint = (f"to keep {size}, accumulate in training_step (step the optimizers every {by_hand.accumulation} batches) "
            f"with AutoBatchSize(max_batch={by_hand.size}), or " if by_hand and by_hand.accumulation > 1 else "to keep it, ")
    rank_zero_warn(
        f"AutoBatchSize: {cause} the checkpoint's {name}={size}: this resumed run trains {name}={micro}, so each "
        f"optimizer step trains {micro} samples{' per rank' if world > 1 else ''} where the checkpoint's run trained "
        f"{size}, and what the learning rate means changes mid-run. Under manual optimization (automatic_optimization="
        f"False) Lightning does not accumulate gradients, so the callback cannot split {size} into micro-batches: "
        f"{hint}{f'max_batch={size} or more' if cause.startswith('max') else 'resume with more memory'}")
    return micro


def dropped_samples(restored: Mapping[str, Any], global_batch: int | None, world: int) -> int | None:
    """Log that the checkpoint's size was for another ``global_batch`` or world size (the callback
    probes again). Return the checkpoint's samples per optimizer step where this run gives no
    ``global_batch`` though the checkpoint's had one: the probe's answer may change them, which
    :func:`changed_samples` says once the size is set (None otherwise)."""
    saved = restored.get("global_batch")
    tell("AutoBatchSize: the checkpoint's batch size was for global_batch=%s over %s rank(s); probing again",
         saved, restored.get("world_size"))
    return saved if global_batch is None and isinstance(saved, int) else None


def changed_samples(before: int | None, size: int | None, accumulation: int, world: int) -> str | None:
    """Warn (and return the warning) where the size set makes other samples per optimizer step (``size`` x
    ``accumulation`` x ``world``) than the checkpoint's ``before`` (:func:`dropped_samples`); None
    where they are the same, or no checkpoint's count is known."""
    if before is None or size is None or size < 1 or size * accumulation * world == before:
        return None
    ranks = f" x {world} ranks" if world > 1 else ""
    warning = (f"the checkpoint trained {before} samples per optimizer step (global_batch={before}); resumed without "
            f"global_batch, this run trains {size * accumulation * world} ({size} x accumulate_grad_batches="
            f"{accumulation}{ranks}), so the samples per step (and what the learning rate means) change mid-run. "
            f"Pass AutoBatchSize(global_batch={before}) to keep the checkpoint's")
    rank_zero_warn(f"AutoBatchSize: {warning}")
    return warning


def overridden_accumulation(restored: Mapping[str, Any], given: int | None, state_key: str) -> str | None:
    """Warn (and return the warning) where the checkpoint's ``accumulation`` replaces the ``accumulate_grad_batches``
    the user gave this run's Trainer (``given``; None or 1 is Lightning's default, nothing
    replaced). Kept, not the user's: the checkpoint's split keeps the run's samples per step and
    batch size (another batch would change the batches of each epoch mid-run). To split anew, the
    callback must probe: it does for a checkpoint without its state (``state_key``), where the
    user's accumulation is then kept if its micro-batches fit."""
    saved = restored.get("accumulation")
    if not saved or given is None or given <= 1 or given == saved:
        return None
    size, total = restored["batch_size"], restored.get("global_batch")
    warning = (f"accumulate_grad_batches={given} (set on the Trainer) is replaced with the checkpoint's "
            f"accumulate_grad_batches={saved} ({size} x {saved} for global_batch={total}): a resumed run keeps the "
            f"checkpoint's split, so it trains the same samples per optimizer step at the same batch size as the run "
            f"it resumes. To split global_batch={total} into {given} micro-batches instead, resume from a copy of the "
            f"checkpoint (best an end-of-epoch one) without this callback's state (del checkpoint['callbacks'][{state_key!r}]): the callback then "
            f"probes again and keeps accumulate_grad_batches={given} where its micro-batches fit; or remove "
            "accumulate_grad_batches from the Trainer")
    rank_zero_warn(f"AutoBatchSize: {warning}")
    return warning


def restored_note(name: str, size: int, accumulation: int | None) -> None:
    """The INFO line of a size (and accumulation) restored from the checkpoint."""
    tell("AutoBatchSize: %s=%d%s restored from the checkpoint and checked to fit, not searched again (a resumed "
         "run trains at the size it trained at)", name, size, f", accumulate_grad_batches={accumulation}" if accumulation else "")
