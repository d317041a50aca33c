"""The throughput objective times a candidate as training runs it: one micro-batch's inputs at a time.

Timing fed ``accumulated_step`` an unsized generator, which the accumulation loop reads one
micro-batch ahead (to know the last one): two micro-batches' inputs were alive during every
forward and backward, where the probe and the runner (``LazyMicroBatches``) hold one, so a
candidate the probe had found to fit could run out of memory while timed.
"""

from __future__ import annotations

import time
import weakref

import torch
from torch import nn

from autobatch import TrainStep
from autobatch.planning.throughput import Candidate, measure_candidates


def test_timing_builds_each_micro_batch_only_after_the_previous_one_is_gone():
    torch.manual_seed(0)
    model = nn.Linear(8, 1).double()
    made: list[weakref.ref] = []
    alive_when_built: list[int] = []

    def make_batch(size: int) -> torch.Tensor:
        alive_when_built.append(sum(ref() is not None for ref in made))
        batch = torch.randn(size, 8, dtype=torch.float64)
        made.append(weakref.ref(batch))
        return batch

    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).pow(2).mean(), make_batch)
    candidate = Candidate.build(16, 4, False)  # 4 micro-batches of 4
    measure_candidates(step, [candidate], global_batch=16, warmup_steps=1, timed_steps=2, timer=time.perf_counter)
    assert candidate.error is None and len(candidate.step_seconds) == 2
    assert len(alive_when_built) == 12  # 3 global steps of 4 micro-batches
    assert max(alive_when_built) == 0, alive_when_built


def test_review39_timed_fp16_steps_step_the_optimizer_whatever_the_scalers_scale():
    """Review 39: the timed candidates ran at the grad scaler's own scale: from a large one
    (``init_scale=2**40``) every timed step's scaled gradients overflowed, the scaler skipped every
    ``optimizer.step()``, and the timing held neither that step nor its state. They run at scale 1
    now, as the probe's trials do; the scaler is put back after."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    stepped: list[int] = []
    optimizer.register_step_post_hook(lambda *_: stepped.append(1))
    step = TrainStep(model, optimizer, lambda m, b: m(b).float().pow(2).mean(), lambda n: torch.randn(n, 6) * 100,
                     autocast_dtype=torch.float16, grad_scaler=scaler)
    candidate = Candidate.build(16, 4, False)
    measure_candidates(step, [candidate], global_batch=16, warmup_steps=1, timed_steps=2, timer=time.perf_counter)
    assert candidate.error is None and len(stepped) == 3
    assert scaler.get_scale() == 2.0**40 and not optimizer.state  # put back: its scale, and no Adam state left
