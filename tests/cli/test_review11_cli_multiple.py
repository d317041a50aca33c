"""``train`` keeps ``probe.multiple_of`` after an OOM recovery: the runner is given the plan's
multiple (it recovered to any size before: 24 halved to 12 with ``probe.multiple_of=8``)."""

from __future__ import annotations

import json

from conftest import SMALL


def test_train_recovers_to_a_multiple_of_probe_multiple_of(cli_here, tmp_path):
    args = ["model=mlp", *SMALL[:3], "probe.max_batch=24", "probe.multiple_of=8", "probe.steps_per_trial=1"]
    done = cli_here("train", *args, "train.global_batch=48", "train.steps=3", "train.inject_oom=[[1,forward]]",
                    "train.grow_after=0")
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "run" / "train_result.json").read_text())
    assert summary["plan"]["micro_batch"] == 24 and summary["samples"] == 3 * 48
    (recovery,) = summary["oom_recoveries"]
    assert (recovery["micro_batch_before"], recovery["micro_batch"]) == (24, 8)  # 12 rounded down to a multiple
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(m["micro_batch"], m["accumulation"], m["samples"]) for m in metrics] == [(24, 2, 48), (8, 6, 48), (8, 6, 48)]
