"""plan(): accumulation when the global batch does not fit, checkpointing when batch 1 does
not fit, and the throughput objective choosing the fastest candidate.

Memory comes from ``memory_limit`` (a simulated CPU budget); the throughput tests use a fake
clock that the model's blocks advance by a known cost per forward, so the best candidate is
known in advance and the test is deterministic (no sleeps, no real timing).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import autobatch
from autobatch import GlobalBatchTooLargeError, NoBatchFitsError, Plan, TrainStep, plan
from autobatch.accumulation import accumulated_step
from autobatch.checkpointing import is_checkpointed
from autobatch.simulated import simulated_memory

WIDTH, TOKENS = 16, 128  # a "sample" is 128 tokens of width 16: activations dominate memory


def block(width: int = WIDTH) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU())


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Costly(nn.Module):
    """A block whose every forward (including a checkpoint's recompute) costs ``cost(n)``."""

    def __init__(self, clock: FakeClock, cost) -> None:
        super().__init__()
        self.clock, self.cost, self.body = clock, cost, block()

    def forward(self, x):
        self.clock.now += self.cost(x.shape[0])
        return self.body(x)


def make_step(model: nn.Module, tokens: int = TOKENS) -> TrainStep:
    return TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=1e-3),
        loss_fn=lambda m, x: m(x).pow(2).mean(),
        make_batch=lambda b: torch.randn(b, tokens, WIDTH),
    )


def deep_mlp(depth: int = 6) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(block() for _ in range(depth)))


# Simulated peaks of deep_mlp (SGD): about 330 KiB per sample plain, 105 KiB checkpointed.
TOO_SMALL_FOR_PLAIN = 256 * 1024  # batch 1 plain does not fit; checkpointed, batch 2 does


def test_global_batch_that_fits_runs_in_one_step():
    result = plan(make_step(deep_mlp(2)), global_batch=4, memory_limit="64MiB", steps_per_trial=1)
    assert (result.micro_batch, result.accumulation_steps, result.checkpointing) == (4, 1, False)
    assert result.micro_batch_sizes == [4]


def test_accumulation_keeps_the_global_batch_balanced_and_round_trips_json():
    model = deep_mlp(2)
    # about 110 KiB per sample: 1 MiB fits 9 (probe says so below), not 21
    result = plan(make_step(model), global_batch=21, memory_limit="1MiB", steps_per_trial=1)
    largest = result.probe_results[0].batch_size
    assert 1 < largest < 21
    assert result.accumulation_steps == -(-21 // largest)
    assert sum(result.micro_batch_sizes) == 21 and max(result.micro_batch_sizes) <= largest
    assert max(result.micro_batch_sizes) - min(result.micro_batch_sizes) <= 1
    assert not result.checkpointing and not any(is_checkpointed(m) for m in model.modules())
    data = json.loads(result.to_json())
    again = Plan.from_dict(data)
    assert again.to_dict() == result.to_dict()
    assert again.probe_results[0].batch_size == largest
    assert "accumulation" in result.summary()
    parts = result.split(torch.arange(21))
    assert [len(p) for p in parts] == result.micro_batch_sizes


def test_no_accumulation_allowed_raises_with_figures():
    with pytest.raises(GlobalBatchTooLargeError, match="global_batch=64 does not fit.*largest batch"):
        plan(
            make_step(deep_mlp(2)),
            global_batch=64,
            memory_limit="1MiB",
            steps_per_trial=1,
            allow_accumulation=False,
            allow_checkpointing=False,
        )


def test_checkpointing_plan_when_batch_one_does_not_fit_and_it_trains():
    model = deep_mlp()
    step = make_step(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules_before = dict(model.named_modules())
    with pytest.raises(NoBatchFitsError):  # the premise: batch 1 does not fit plainly
        autobatch.find_max_batch(step, memory_limit=TOO_SMALL_FOR_PLAIN, steps_per_trial=1, max_batch=8)

    result = plan(step, global_batch=8, memory_limit=TOO_SMALL_FOR_PLAIN, steps_per_trial=1)
    assert result.checkpointing and result.checkpointed_modules == [str(i) for i in range(6)]
    assert [p["checkpointing"] for p in result.probes] == [False, True]
    assert [p["fits"] for p in result.probes] == [False, True]
    assert result.accumulation_steps > 1 and sum(result.micro_batch_sizes) == 8
    assert all(is_checkpointed(model[i]) for i in range(6))  # left on: the plan uses it
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # probes restored

    # It trains: one optimizer step over the whole global batch within the same budget.
    batch = torch.randn(8, TOKENS, WIDTH)
    with simulated_memory(TOO_SMALL_FOR_PLAIN):
        loss = accumulated_step(step, result.split(batch), global_batch=8)
    assert loss > 0 and not all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    result.undo()
    assert not any(is_checkpointed(m) for m in model.modules())
    assert dict(model.named_modules()) == modules_before
    assert list(model.state_dict()) == list(before)

    loaded = Plan.from_dict(json.loads(result.to_json()))  # a saved plan, applied again
    handle = loaded.apply(model)
    assert handle.modules == result.checkpointed_modules and all(is_checkpointed(model[i]) for i in range(6))
    loaded.undo()
    assert not any(is_checkpointed(m) for m in model.modules())


def test_nothing_fits_even_with_checkpointing_says_so():
    model = deep_mlp()
    with pytest.raises(NoBatchFitsError, match="with activation checkpointing of 6 blocks.*without it batch 1") as info:
        plan(make_step(model), global_batch=8, memory_limit="48KiB", steps_per_trial=1)
    assert [p["checkpointing"] for p in info.value.attempts] == [False, True]
    assert all(p["peak_bytes"] for p in info.value.attempts)
    assert not any(is_checkpointed(m) for m in model.modules())  # left unwrapped


def test_checkpointing_not_allowed_reraises_the_probe_error():
    model = deep_mlp()
    with pytest.raises(NoBatchFitsError) as info:
        plan(make_step(model), global_batch=8, memory_limit=TOO_SMALL_FOR_PLAIN, steps_per_trial=1, allow_checkpointing=False)
    assert "checkpointing of" not in str(info.value)


def test_throughput_picks_the_known_fastest_micro_batch():
    """Per block forward: 10 + n + 3 * max(0, n - 8) time units for a micro-batch of n (fixed
    overhead, then slower per sample past 8). For a global batch of 32 the global step (2
    blocks) costs 704, 384, 224, 144, 200, 228 for micro-batches 1..32: 8 x 4 is the best."""
    clock = FakeClock()
    torch.manual_seed(0)
    model = nn.Sequential(*(Costly(clock, lambda n: 10 + n + 3 * max(0, n - 8)) for _ in range(2)))
    step = make_step(model, tokens=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = plan(
        step,
        global_batch=32,
        objective="throughput",
        memory_limit="64MiB",
        steps_per_trial=1,
        min_micro_batch=1,
        warmup_steps=0,
        timed_steps=1,
        timer=clock,
    )
    speeds = {c["micro_batch"]: c["samples_per_s"] for c in result.candidates}
    step_cost = {1: 704, 2: 384, 4: 224, 8: 144, 16: 200, 32: 228}
    assert speeds == pytest.approx({n: 32 / cost for n, cost in step_cost.items()})
    assert (result.micro_batch, result.accumulation_steps, result.checkpointing) == (8, 4, False)
    assert [c["chosen"] for c in result.candidates].count(True) == 1
    assert result.samples_per_s == pytest.approx(max(speeds.values()))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # timing restored
    assert "| 8 | 4 | no |" in result.summary()
    json.dumps(result.to_dict())


def test_throughput_prefers_checkpointing_when_it_allows_larger_micro_batches():
    """A large fixed cost per forward (100 + n) rewards big micro-batches even though a
    checkpointed block runs its forward twice."""
    clock = FakeClock()
    torch.manual_seed(0)
    model = nn.Sequential(*(Costly(clock, lambda n: 100 + n) for _ in range(6)))
    step = make_step(model, tokens=32)  # about 84 KiB per sample plain, 27 KiB checkpointed
    result = plan(
        step,
        global_batch=12,
        objective="throughput",
        memory_limit=175_000,
        steps_per_trial=1,
        warmup_steps=0,
        timed_steps=1,
        timer=clock,
    )
    plain = [c for c in result.candidates if not c["checkpointing"]]
    wrapped = [c for c in result.candidates if c["checkpointing"]]
    assert plain and wrapped
    assert min(c["micro_batch"] for c in wrapped) > max(c["micro_batch"] for c in plain)
    best = max(result.candidates, key=lambda c: c["samples_per_s"])
    assert best["checkpointing"] and best["chosen"]
    assert result.checkpointing and (result.micro_batch, result.accumulation_steps) == (best["micro_batch"], best["accumulation_steps"])
    assert all(is_checkpointed(model[i]) for i in range(6))
    loss = accumulated_step(step, result.split(torch.randn(12, 32, WIDTH)), global_batch=12)
    assert loss > 0
    result.undo()
    assert not any(is_checkpointed(m) for m in model.modules())


def test_bad_arguments():
    step = make_step(deep_mlp(1))
    with pytest.raises(ValueError, match="global_batch"):
        plan(step, global_batch=0)
    with pytest.raises(ValueError, match="objective"):
        plan(step, global_batch=4, objective="fast")
    with pytest.raises(TypeError, match="TrainStep"):
        plan(lambda b: None, global_batch=4)


def test_candidate_sizes():
    from autobatch.throughput import balanced_micro_batch, candidate_micro_batches

    assert balanced_micro_batch(64, 24) == 22 and balanced_micro_batch(64, 64) == 64
    assert candidate_micro_batches(64, 24, smallest=1) == [1, 2, 4, 8, 16, 22]
    assert candidate_micro_batches(32, 100) == [2, 4, 8, 16, 32]  # default: from largest // 16
    assert candidate_micro_batches(64, 24, smallest=1, multiple_of=8) == [8, 16, 24]


def test_multiple_of_keeps_micro_batches_multiples():
    result = plan(make_step(deep_mlp(2)), global_batch=21, memory_limit="1MiB", steps_per_trial=1, multiple_of=4)
    assert result.micro_batch % 4 == 0 and not result.balanced
    assert all(size % 4 == 0 for size in result.micro_batch_sizes[:-1]) and sum(result.micro_batch_sizes) == 21


def test_a_candidate_that_runs_out_of_memory_while_timed_is_recorded_and_skipped():
    from autobatch.throughput import Candidate, measure_candidates

    clock = FakeClock()
    model = nn.Sequential(*(Costly(clock, lambda n: n) for _ in range(2)))
    step = make_step(model, tokens=2)
    make = step.make_batch

    def make_batch(b):
        if b == 8:
            raise torch.OutOfMemoryError("Simulated out of memory: test")
        return make(b)

    step.make_batch = make_batch
    before = {k: v.clone() for k, v in model.state_dict().items()}
    candidates = [Candidate.build(16, m, False) for m in (4, 8, 16)]
    measure_candidates(step, candidates, global_batch=16, warmup_steps=0, timed_steps=1, timer=clock)
    assert [c.error is not None for c in candidates] == [False, True, False]
    assert candidates[1].samples_per_s is None and candidates[0].samples_per_s == pytest.approx(16 / 32)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
