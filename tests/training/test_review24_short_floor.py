"""Review 24: a short last batch whose one piece is already no larger than ``min_micro_batch``.
Its OOM "recovered" to the floor (2 samples at micro-batch 8, then 3), which ran the same piece
of 2 again, to fail again: one wasted replay, and a give-up saying it ran out "at micro-batch 3,
the smallest min_micro_batch=3 allows" of a piece of 2. Now the floor is reached at once (the
fallback, checkpointing, comes first) and the message names the piece."""

from __future__ import annotations

import pytest
import torch

from autobatch import Runner
from autobatch.errors import StepOutOfMemoryError
from autobatch.training.oom.faults import FaultInjector


def _runner(faults, fallback):
    torch.manual_seed(0)
    block = lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))  # noqa: E731
    model = torch.nn.Sequential(block(), block(), torch.nn.Linear(4, 1))
    return Runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                  lambda m, b: ((m(b[0]).squeeze(-1) - b[1]) ** 2).mean(), global_batch=8, micro_batch=8,
                  min_micro_batch=3, device="cpu", progress=False, faults=faults, checkpointing_fallback=fallback)


def _data():
    x, y = torch.randn(18, 4), torch.randn(18)
    return [(x[:8], y[:8]), (x[8:16], y[8:16]), (x[16:], y[16:])]  # a last batch of 2


@pytest.mark.filterwarnings("ignore")
def test_a_short_piece_at_the_floor_turns_to_checkpointing_at_once():
    runner = _runner(FaultInjector([(2, "backward")], times=1), fallback=True)
    result = runner.fit(_data(), epochs=1)
    assert [(r["micro_batch_before"], r["micro_batch"], r["action"]) for r in result.oom_recoveries] == [
        (8, 8, "checkpointing")]


@pytest.mark.filterwarnings("ignore")
def test_a_short_piece_at_the_floor_gives_up_naming_the_piece():
    runner = _runner(FaultInjector([(2, "backward")], times=None), fallback=False)
    with pytest.raises(StepOutOfMemoryError, match=r"at micro-batch 8, whose pieces of this batch hold at most 2 "
                                                    r"samples, and no smaller piece is one min_micro_batch=3 allows"):
        runner.fit(_data(), epochs=1)
    assert runner.result.oom_recoveries == []  # no replay of the same piece
