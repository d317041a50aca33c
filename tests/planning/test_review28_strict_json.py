"""Plans and probe results are strict JSON: a throughput candidate whose median step the clock
measured as 0 s had ``samples_per_s = inf``, and ``Plan.to_json()`` / the CLI's ``plan.json``
held ``Infinity``, which is no JSON (``jq``, ``JSON.parse`` refuse the whole file). Every figure
that is not finite is now ``null`` in the JSON (docs/planning.md)."""

from __future__ import annotations

import json
import math

import torch

from autobatch import Plan, ProbeResult, plan
from autobatch.planning.throughput import Candidate

from test_planner import block, make_step  # a small model and its step


def test_a_plan_timed_by_a_clock_that_did_not_move_is_strict_json():
    """The whole throughput planner, its clock standing still: every median step is 0 s."""
    step = make_step(torch.nn.Sequential(block(), block()), tokens=2)
    result = plan(step, global_batch=16, objective="throughput", memory_limit="64MiB", steps_per_trial=1,
                  min_micro_batch=8, warmup_steps=0, timed_steps=1, retime_rounds=0, timer=lambda: 0.0, cache=False)
    chosen = [c for c in result.candidates if c["chosen"]]
    assert len(chosen) == 1 and chosen[0]["seconds_per_step"] == 0.0
    text = json.dumps(result.to_dict(), allow_nan=False)  # raised: Out of range float values
    again = Plan.from_dict(json.loads(text))
    assert again.samples_per_s is None and again.micro_batch == result.micro_batch
    assert "Infinity" not in result.to_json()


def test_candidate_and_probe_result_dicts_have_no_infinite_figures():
    candidate = Candidate.build(8, 8, False)
    candidate.record([0.0, 0.0], None, 8)
    assert candidate.samples_per_s == math.inf  # in memory it still ranks as the fastest
    assert candidate.to_dict()["samples_per_s"] is None and candidate.to_dict()["step_seconds"] == [0.0, 0.0]
    probe = ProbeResult(batch_size=4, strategy="auto", strategy_used="binary", trials=[], capacity_bytes=None,
                        elapsed_s=0.0, margin=0.1, fit={"kind": "linear", "slope_bytes_per_sample": math.nan})
    data = json.loads(json.dumps(probe.to_dict(), allow_nan=False))
    assert data["fit"]["slope_bytes_per_sample"] is None and data["fit"]["kind"] == "linear"
