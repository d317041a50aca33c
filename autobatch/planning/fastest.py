"""The planner's ``throughput`` objective: generate candidate plans and time them.

A mixin of the planner's per-call state: :meth:`ThroughputObjective.fastest` probes the
plain (and, where it helps, the checkpointed) model, turns the largest fits into candidate
micro-batches (:func:`~autobatch.planning.throughput.candidate_micro_batches`), times them
(:func:`~autobatch.planning.throughput.measure_candidates`, leaders re-timed in interleaved
rounds) and builds the plan of the fastest.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager

import torch

from ..errors import GlobalBatchTooLargeError, NoBatchFitsError
from ..memory.devices import AcceleratorMemory, resolve_device
from ..memory.units import parse_bytes
from .batch_statistics import batch_norm_layers
from .plan_result import Plan, speed_text
from .throughput import TIE_WITHIN, Candidate, DeviceHooks, candidate_micro_batches, leaders, measure_candidates

__all__ = ["ThroughputObjective"]


class ThroughputObjective:
    """``objective="throughput"`` for the planner (which provides probe, wrap, build, ...)."""

    #: the accumulated probe's error where micro-batch 1 fits one step but not accumulated
    accumulation_error: NoBatchFitsError | None = None

    def fastest(
        self,
        allow_accumulation: bool,
        allow_checkpointing: bool,
        balanced: bool,
        *,
        min_micro_batch: int | None,
        exhaustive: bool,
        timing: dict[str, Any],
        timer: Callable[[], float],
        allocator_retries: Callable[[], int | None] | None,
    ) -> Plan:
        plain, plain_error = self.probe(False)
        plain_max = self.with_accumulation(plain, False, allow_accumulation)
        ckpt = ckpt_error = None
        if allow_checkpointing and (exhaustive or plain_max < self.global_batch):
            ckpt, ckpt_error = self.probe_checkpointed()
        if plain is None and ckpt is None:
            raise self.no_fit(plain_error, ckpt_error, allow_checkpointing)
        ckpt_max = self.with_accumulation(ckpt, True, allow_accumulation)

        def sizes(largest: int, above: int = 0) -> list[int]:
            if largest == 0:
                return []
            if not allow_accumulation:
                return [self.global_batch] if largest >= self.global_batch else []
            multiple_of = self.probe_kwargs.get("multiple_of", 1)
            found = candidate_micro_batches(
                self.global_batch, largest, smallest=min_micro_batch, multiple_of=multiple_of
            )
            return [size for size in found if size > above]

        plain_candidates = [Candidate.build(self.global_batch, m, False, balanced=balanced) for m in sizes(plain_max)]
        ckpt_candidates = [
            Candidate.build(self.global_batch, m, True, balanced=balanced)
            for m in sizes(ckpt_max, 0 if exhaustive else plain_max)
        ]
        if not plain_candidates and not ckpt_candidates:
            if self.accumulation_error is not None:  # one step fits micro-batch 1, accumulation none
                raise self.accumulation_error
            largest, wrapped = max((plain_max, False), (ckpt_max, True))
            raise GlobalBatchTooLargeError(self.global_batch, largest, wrapped, (plain or ckpt).device)

        device = resolve_device(self.probe_kwargs.get("device") or self.step.device)
        if device.type == "cpu":
            self.notes.append(
                "CPU: candidates were timed without the simulated memory budget (it slows every "
                "operator); the probes had already checked that they fit"
            )
        candidates = self.without_one_sample(plain_candidates + ckpt_candidates, balanced)
        candidates = sorted(candidates, key=lambda c: (c.checkpointing, c.micro_batch))
        retimed = self.time(candidates, device, timing, timer, allocator_retries)
        timed = [c for c in candidates if c.samples_per_s is not None]
        if not timed:
            raise MemoryError(
                "every candidate plan ran out of memory while being timed, though the probe found "
                f"them to fit: {[c.error for c in candidates]}; lower memory pressure (margin=0.1)"
            )
        best = _pick(timed)
        best.chosen = True
        reason = (
            f"fastest of {len(timed)} timed candidates at the median step: {speed_text(best.samples_per_s)} "
            f"(micro-batch {best.micro_batch} x {best.accumulation_steps}, checkpointing "
            f"{'on' if best.checkpointing else 'off'})"
        )
        fastest = max(c.samples_per_s for c in timed)
        if best.samples_per_s < fastest:
            reason += (f", within {TIE_WITHIN:.0%} of the fastest median ({speed_text(fastest)}): a tie, which goes to "
                       "fewer accumulation steps, then to no checkpointing")
        if retimed:
            reason += (
                f"; the {len(retimed)} within {timing['retime_within']:.0%} of the best were re-timed in "
                f"{timing['retime_rounds']} interleaved rounds"
            )
        if best.retried:
            self.notes.append(
                f"the chosen candidate hit {best.alloc_retries} allocator retries while timed (memory "
                "pressure: the cache was flushed to retry an allocation); its median includes them"
            )
        return self.build(
            best.micro_batch,
            best.checkpointing,
            "throughput",
            reason,
            balanced,
            candidates=[c.to_dict() for c in candidates],
            timing=dict(timing, retimed=len(retimed)),
        )

    def without_one_sample(self, candidates: list[Candidate], balanced: bool) -> list[Candidate]:
        """The candidates worth timing for a model with BatchNorm in training: none with a micro-batch
        of one sample where others are left (a note names them), since the probes, stopping above
        batch 1, never tried one, and BatchNorm1d cannot train on it ("Expected more than 1 value per
        channel": the default smallest candidate, largest // 16, is 1 below 32, and a global batch of 8
        that fitted in one step raised it); where every candidate has one, a trial at batch 1 first
        (:meth:`check_one_sample`: the model's error, with what to change)."""
        single = [c for c in candidates if min(c.micro_batch_sizes) == 1]
        if not single or batch_norm_layers(self.step.model) is None:
            return candidates
        kept = [c for c in candidates if min(c.micro_batch_sizes) > 1]
        if not kept:
            first = single[0]
            self.check_one_sample(first.micro_batch_sizes, first.micro_batch, first.checkpointing, balanced)
            return candidates
        self.notes.append(f"not timed: {', '.join(f'{c.micro_batch} x {c.accumulation_steps}' for c in single)}, whose "
                          "micro-batches include one of a single sample, which the model's BatchNorm in training normalises "
                          "alone (BatchNorm1d cannot train on it) and no probe tried")
        return kept

    def with_accumulation(self, one_step, checkpointing: bool, allow_accumulation: bool) -> int:
        """The largest micro-batch a candidate may use: the global batch where it fits in one
        step (no margin off it: :meth:`fits`), ``one_step``'s answer where accumulation is not
        allowed, else the largest micro-batch of an accumulated step less the margin, taken once
        (the planner's second probe: the first micro-batch's gradients stay held through the
        next one's step; a candidate sized by the one-step answer ran out of memory in
        training); 0 where nothing fits (the accumulated probe's error is kept in
        ``accumulation_error``, raised if no candidate is left)."""
        if one_step is None:
            return 0
        if self.fits(one_step):
            return self.global_batch
        if not allow_accumulation:
            return one_step.batch_size
        try:
            return self.accumulated(one_step, checkpointing)
        except NoBatchFitsError as exc:
            self.accumulation_error = exc
            return 0

    def time(self, candidates, device, timing, timer, allocator_retries) -> list[Candidate]:
        """Time every candidate once, then the leaders in interleaved rounds; return the
        re-timed leaders (none when fewer than two lead or ``retime_rounds`` is 0)."""
        options = dict(
            global_batch=self.global_batch,
            warmup_steps=timing["warmup_steps"],
            timed_steps=timing["timed_steps"],
            timer=timer,
            hooks=DeviceHooks.for_device(device, allocator_retries),
            prepare=lambda candidate: self.wrap() if candidate.checkpointing else self.unwrap(),
        )
        with _measurement_memory(device, self.probe_kwargs.get("memory_limit")):
            try:
                measure_candidates(self.step, candidates, **options)
                front = leaders(candidates, timing["retime_within"])
                if len(front) < 2 or not timing["retime_rounds"]:
                    return []
                measure_candidates(self.step, front, rounds=timing["retime_rounds"], **options)
                return front
            finally:
                self.unwrap()



def _pick(timed: list[Candidate]) -> Candidate:
    """The candidate to plan: among those whose median samples/s is within :data:`TIE_WITHIN` of the
    fastest's (a tie: timing noise cannot order them, and the exact fastest changed from run to run),
    the one with the fewest accumulation steps, then without checkpointing, then the fastest."""
    fastest = max(c.samples_per_s for c in timed)
    tied = [c for c in timed if c.samples_per_s >= (1 - TIE_WITHIN) * fastest]
    return min(tied, key=lambda c: (c.accumulation_steps, c.checkpointing, -c.samples_per_s))


def _measurement_memory(device: torch.device, memory_limit: int | str | None) -> ContextManager:
    """Accelerators: time under the same cap the probe used. CPU: no simulated budget."""
    if device.type == "cpu" or memory_limit is None:
        return nullcontext()
    return AcceleratorMemory(device).capped(parse_bytes(memory_limit, name="memory_limit"))
