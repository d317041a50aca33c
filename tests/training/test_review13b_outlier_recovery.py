"""OOM recovery when one batch costs far more than the run's memory line (a 128-token batch in a
run sized on 16-token ones): the replays of that step stay few, the next ordinary batch trains at
the size before it, and a transient squeeze still costs a few percent (tests/training/test_promise.py).

Run as a script for the figures in docs/promise.md (failed attempts, the micro-batch of every step):
``python tests/training/test_review13b_outlier_recovery.py``."""

from __future__ import annotations

import logging

import torch
from torch.nn import functional as F

import autobatch
from autobatch.training.oom.growth import GrowBack
from autobatch.training.oom.step_memory import StepMemory
from autobatch.workloads.models import GPT

SEEN: list[int] = []  # sample ids of the running attempt's micro-batches


def next_token(model, batch):
    tokens, ids = batch
    SEEN.extend(ids.tolist())
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def outlier_run(budget="4MiB", global_batch=32, micro_batch=32, outliers=(3,), steps=5, short=16, long=128,
                width=32, layers=2, squeeze_at=None):
    """Train a small GPT on ``short``-token batches, ``long`` ones at the steps in ``outliers``
    (and 5 % of the budget taken for good after step ``squeeze_at``); returns the run's result,
    the micro-batch of every step, and whether every sample trained exactly once."""
    torch.manual_seed(0)
    model = GPT(vocab_size=64, max_seq_len=long + 1, layers=layers, width=width, heads=2)
    optimizer = torch.optim.AdamW(model.parameters())
    data = [(torch.randint(0, 64, (global_batch, (long if step in outliers else short) + 1)),
             torch.arange(step * global_batch, (step + 1) * global_batch)) for step in range(steps)]
    sizes, trained, squeeze = [], [], []
    SEEN.clear()
    with autobatch.simulated_memory(budget) as device:

        def on_step_end(info):
            sizes.append(info["micro_batch"])
            trained.extend(SEEN[-global_batch:])  # the committed attempt's samples
            SEEN.clear()
            if info["step"] == squeeze_at:
                squeeze.append(torch.empty(device.limit_bytes // 20, dtype=torch.uint8))

        runner = autobatch.Runner(model, optimizer, next_token, global_batch=global_batch, micro_batch=micro_batch,
                                  progress=False)
        result = runner.fit(data, on_step_end=on_step_end)
    once = sorted(trained) == list(range(steps * global_batch))
    return result, sizes, once


def failed_at(result, step):
    return [r["micro_batch_before"] for r in result.oom_recoveries if r["step"] == step]


def test_an_outlier_batch_costs_few_replays_and_the_next_batch_trains_at_the_old_size():
    result, sizes, once = outlier_run(budget="2MiB", width=16, layers=1)  # docs/promise.md's first run, smaller
    assert once and result.samples == 5 * 32
    assert len(failed_at(result, 3)) <= 3, result.oom_recoveries  # creeping down: 32, 28, 14, 10 failed
    assert sizes[:3] == [32, 32, 32] and sizes[4] == 32, sizes  # was 7 at step 4


def test_a_measured_size_that_fails_again_in_the_same_step_steps_down_at_least_twice_as_far():
    """The cap on a repeated failure's optimism, on the simulated device's figures alone."""
    with autobatch.simulated_memory("1MiB") as device:
        memory = StepMemory(torch.device("cpu"))
        memory.begin()
        block = torch.empty(900_000, dtype=torch.uint8)  # the failed attempt's peak, then freed
        del block
        error = "Simulated out of memory. Tried to allocate 200.00 KiB in aten::empty"
        first = memory.after_oom(32, error)
        assert first is not None and 24 <= first < 32  # proportional: 32 x room / needed
        plain = memory.after_oom(30, error)
        assert memory.after_oom(30, error, previous=32) == plain  # no line said 30 fits: its own figures
        memory.outlier = True  # as after_oom sets it where the line says the failed size fits
        assert memory.after_oom(30, error, previous=32) == min(plain, 26)  # the previous pick was 2 too optimistic: 4 now
        assert memory.after_oom(16, error, previous=32) == 8  # never less than half
    assert device.oom_count == 0


def test_the_try_after_an_outlier_that_fails_waits_as_a_failed_quick_try():
    """The data changed for good (every batch long now): one failed try, then the doubled wait."""
    growth = GrowBack(100, ceiling=32)
    growth.propose(32)
    growth.on_oom()
    growth.squeezed(32)  # the outlier step's measured recovery, to 4
    growth.on_step_done(outlier=True)
    assert growth.propose(4, fits=32) == 32  # at once, not after a step at 4
    assert growth.on_oom() == 4 and growth.quick_wait == 2  # the next batch was long too
    growth.on_step_done()
    assert growth.propose(4, fits=32) == 4  # no try in the step after a failed one
    growth.on_step_done()
    assert growth.propose(4, fits=32) == 4
    growth.on_step_done()
    assert growth.propose(4, fits=32) == 32  # two OOM-free steps: the next quick try


def figures() -> None:
    """The before/after figures of docs/promise.md: failed attempts of each outlier step and the
    micro-batch of every step."""
    logging.disable(logging.WARNING)
    runs = {"4 MiB, 32 of 32, a 128-token step 3": {},
            "2 MiB, 22 of 32, a 128-token step 3": dict(budget="2MiB", micro_batch=22),
            "8 MiB, 64 of 64, 128-token steps 2, 5, 9": dict(budget="8MiB", global_batch=64, micro_batch=64,
                                                         outliers=(2, 5, 9), steps=12),
            "4 MiB, 32 of 32, 128-token steps 3 to 8": dict(outliers=range(3, 9), steps=10),
            "4 MiB, 47 of 47, 5 % squeeze after step 2": dict(global_batch=47, micro_batch=47, outliers=(),
                                                              squeeze_at=2, steps=6)}
    for name, options in runs.items():
        result, sizes, once = outlier_run(**options)
        fails = {s: failed_at(result, s) for s in sorted({r["step"] for r in result.oom_recoveries})}
        print(f"{name}: failed attempts {fails}; micro-batch per step {sizes}; every sample once: {once}; "
              f"grow-back tries {[(g['step'], g['to'], g['held']) for g in result.grow_attempts]}")


if __name__ == "__main__":
    figures()
