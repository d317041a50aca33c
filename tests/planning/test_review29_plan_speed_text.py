"""Review 29: a throughput plan timed by a clock too coarse for one step (every median step 0 s)
said "fastest of 3 timed candidates at the median step: inf samples/s", and its candidates
table showed "-" (not timed) for candidates that were timed."""

from __future__ import annotations

import logging

import torch

from autobatch import plan

from test_planner import block, make_step  # a small model and its step


def test_a_plan_whose_clock_did_not_move_says_too_fast_to_time(caplog):
    step = make_step(torch.nn.Sequential(block(), block()), tokens=2)
    with caplog.at_level(logging.INFO, logger="autobatch"):
        result = plan(step, global_batch=16, objective="throughput", memory_limit="64MiB", steps_per_trial=1,
                      min_micro_batch=8, warmup_steps=0, timed_steps=1, retime_rounds=0, timer=lambda: 0.0,
                      cache=False)
    assert "inf" not in result.reason and "too fast to time" in result.reason
    rows = [line for line in str(result).splitlines() if line.startswith("| 8 ") or line.startswith("| 16 ")]
    assert len(rows) == 2 and all("too fast to time" in row for row in rows)
    timed = [record.getMessage() for record in caplog.records if record.getMessage().startswith("candidate micro=")]
    assert timed and all("inf" not in message and "too fast to time" in message for message in timed)
