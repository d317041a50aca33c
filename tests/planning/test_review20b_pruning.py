"""The throughput objective's choice under timing noise: pruning and ties.

A candidate was pruned after its first timed step alone took more than twice the best median so
far, so one slow step (a GC pause, a cold cache, another process) ruled out the fastest plan: with
five candidates of a global batch of 64 and one 1000-unit spike at each timed forward in turn, the
fastest (16 x 4) was lost for the 8 positions in its first timed step. Now its first PRUNE_STEPS
steps must each be that slow. Ties: candidates within TIE_WITHIN of the fastest median are ordered
by fewer accumulation steps, then no checkpointing (the tie rule used to fire on equal floats only).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autobatch import plan
from autobatch.planning.throughput import PRUNE_FACTOR, PRUNE_STEPS, TIE_WITHIN, Candidate, measure_candidates

from test_planner import Costly, FakeClock, make_step  # the fake clock and costed blocks


def spiked_model(clock: FakeClock, cost, spike_at: int | None, spike: float = 1000.0) -> nn.Module:
    """Two blocks costing ``cost(n)`` a forward; the ``spike_at``-th forward while a step is timed
    costs ``spike`` more (one GC pause)."""
    seen = {"timed": 0}

    def costed(n: int) -> float:
        if clock.timing:
            seen["timed"] += 1
            if seen["timed"] == spike_at:
                return cost(n) + spike
        return cost(n)

    torch.manual_seed(0)
    return nn.Sequential(*(Costly(clock, costed) for _ in range(2)))


@pytest.mark.parametrize("spike_at", [7, 10, None])  # forwards 7-10: micro-batch 8's first timed step (16 x 1: 1-6)
def test_one_slow_step_does_not_prune_the_fastest_candidate(spike_at):
    """16 x 1 (2 x 50 a step) is timed first; 8 x 2 (4 x 18 = 72) is the fastest. A spike in 8's
    first timed step (1072 > 2 x 100) pruned it after that step; its second step (72) clears it."""
    clock = FakeClock()
    cost = {16: 50.0, 8: 18.0}.get
    step = make_step(spiked_model(clock, cost, spike_at), tokens=2)
    candidates = [Candidate.build(16, m, False) for m in (8, 16)]
    measure_candidates(step, candidates, global_batch=16, warmup_steps=1, timed_steps=3, timer=clock)
    eight, sixteen = candidates
    assert sixteen.step_seconds == [100.0] * 3
    assert not eight.pruned and len(eight.step_seconds) == 3 and eight.seconds_per_step == 72.0
    assert eight.step_seconds[0] == (72.0 if spike_at is None else 1072.0)  # the spike: over PRUNE_FACTOR x 100
    assert 1072.0 > PRUNE_FACTOR * 100


@pytest.mark.parametrize("timed_steps", [2, 3])
def test_a_candidate_slow_in_every_first_step_is_pruned_after_prune_steps_unless_that_is_all(timed_steps):
    """8 x 2 slow in every step (4 x 60 = 240 > 2 x 100) stops after PRUNE_STEPS steps; with no more
    timed steps than that there is nothing to save, and it is timed in full, not marked pruned."""
    clock = FakeClock()
    step = make_step(spiked_model(clock, {16: 50.0, 8: 60.0}.get, None), tokens=2)
    candidates = [Candidate.build(16, m, False) for m in (8, 16)]
    measure_candidates(step, candidates, global_batch=16, warmup_steps=0, timed_steps=timed_steps, timer=clock)
    eight = candidates[0]
    assert eight.pruned == (timed_steps > PRUNE_STEPS)
    assert eight.step_seconds == [240.0] * min(timed_steps, PRUNE_STEPS if eight.pruned else timed_steps)


@pytest.mark.parametrize("sixteen_cost, chosen", [(24.9, (32, 1)), (24.0, (16, 2))])
def test_candidates_within_timing_noise_tie_and_go_to_fewer_accumulation_steps(sixteen_cost, chosen):
    """32 x 1 costs 100 a step; 16 x 2 costs 99.6 (0.4 % faster: a tie, within TIE_WITHIN) or 96 (4 %:
    faster beyond noise). The tie went to the faster by a hair, so the plan changed from run to run."""
    clock = FakeClock()
    step = make_step(spiked_model(clock, lambda n: {32: 50.0, 16: sixteen_cost}.get(n, 1.0), None), tokens=2)
    result = plan(step, global_batch=32, objective="throughput", memory_limit="64MiB", steps_per_trial=1,
                  min_micro_batch=16, warmup_steps=0, timed_steps=3, retime_rounds=0, timer=clock, cache=False)
    assert (result.micro_batch, result.accumulation_steps) == chosen
    tie = 4 * sixteen_cost >= (1 - TIE_WITHIN) * 100
    assert tie == (chosen == (32, 1)) and ("a tie, which goes to fewer accumulation steps" in result.reason) == tie
    assert [c["micro_batch"] for c in result.candidates if c["chosen"]] == [chosen[0]]
