"""A planned runner keeps the multiple it planned with: ``Runner(micro_batch=None,
plan_options={"multiple_of": 8})`` adopts 8 (``runner.multiple_of``), and ``Runner(multiple_of=8)``
hands it to the planner; either way the plan's micro-batch, an OOM recovery's and every piece
trained are multiples of 8."""

from __future__ import annotations

import torch
from torch import nn

from autobatch import FaultInjector, Runner

GLOBAL = 1000
PLAN = {"memory_limit": "1500KiB", "strategy": "binary", "cache": False}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def _data(batches: int = 3):
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(GLOBAL, 32, generator=generator), torch.randint(0, 10, (GLOBAL,), generator=generator))
            for _ in range(batches)]


def _planned(sizes: list[int], **options) -> Runner:
    model = _model()

    def loss_fn(m, batch):
        sizes.append(int(batch[0].shape[0]))
        return nn.functional.cross_entropy(m(batch[0]), batch[1])

    options = {"global_batch": GLOBAL, "micro_batch": None, "grow_after": 1, "progress": False, "log_every": None,
               **options}
    return Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, **options)


def test_the_probe_options_multiple_is_kept_through_a_recovery_and_a_grow_back():
    sizes: list[int] = []
    runner = _planned(sizes, plan_options={**PLAN, "multiple_of": 8}, faults=FaultInjector([(1, "forward")], times=2))
    assert runner.multiple_of == 8 and runner.min_micro_batch == 8
    result = runner.fit(_data(4))
    planned = result.plan["micro_batch"]
    assert planned % 8 == 0 and planned < GLOBAL  # accumulation: the recovery has room to shrink
    assert [r["micro_batch"] % 8 for r in result.oom_recoveries] == [0, 0]
    assert result.grow_attempts and all(a["to"] % 8 == 0 for a in result.grow_attempts)
    assert all(size % 8 == 0 for size in sizes), sorted(set(sizes))


def test_the_runners_multiple_goes_to_the_planner():
    sizes: list[int] = []
    runner = _planned(sizes, multiple_of=8, plan_options=PLAN, grow_after=None)
    assert runner.plan_options["multiple_of"] == 8
    result = runner.fit(_data(1))
    assert all(size % 8 == 0 for size in result.plan["micro_batch_sizes"]) and not runner.balanced
    planned = result.plan["micro_batch_sizes"]
    assert sizes[-len(planned):] == planned  # the step trained the plan's split (the probe's trials came first)
