"""Why does the CLI's ``train`` at its own answer run out of memory in the process that probed, and
not in a new one? (issue 16; ViT-B/16 under an 8 GiB cap, expandable segments: 103 trained 200
steps in a new process and failed at step 78 after probing in the same one.)

Each mode runs in its own new process, the CLI's own code path (compose, ``build_workload``,
``run_probe``, ``run_training`` within ``training_memory``), and records after every optimizer
step what stays allocated and reserved, plus each recovery's error:

* ``same``: probe (no cache), then train at the answer, as ``train probe.cache=false`` does;
* ``same_gc``: the same with a full garbage collection and an emptied cache between the two;
* ``fresh``: train at ``--batch`` (the answer) with no probe, as a cache hit does.

    python scripts/diag_cli_same.py --modes same,same_gc,fresh --overrides model=resnet50 \
        model._target_=torchvision.models.vit_b_16 data=imagenet data.num_classes=10 precision=bf16 \
        device.type=cuda probe.memory_limit=8GiB
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def child(mode: str, overrides: list[str], batch: int | None, steps: int) -> dict:
    from hydra import compose, initialize_config_module
    from torch.optim.optimizer import register_optimizer_step_post_hook

    import autobatch.cli  # noqa: F401 - the schemas
    from autobatch.cli.build import build_workload, training_memory
    from autobatch.cli.commands import run_probe
    from autobatch.cli.training import run_training

    out: dict = {"mode": mode}
    with initialize_config_module("autobatch.conf", version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, f"train.steps={steps}", "probe.cache=false"])
    workload = build_workload(cfg)
    if mode != "fresh":
        result = run_probe(cfg, workload)
        batch = result.batch_size
        out["probe_trials"] = [(t.batch_size, t.passed, t.purpose) for t in result.trials]
        out["after_probe"] = _figures()
        if mode == "same_gc":
            gc.collect()
            torch.cuda.empty_cache()
            out["after_gc"] = _figures()
    out["batch"] = batch
    rows: list = []
    hook = register_optimizer_step_post_hook(lambda *_: rows.append(_figures()))
    with tempfile.TemporaryDirectory() as tmp, training_memory(cfg, workload.device):
        run, _ = run_training(cfg, workload, global_batch=batch, micro_batch=batch, out_dir=Path(tmp))
    hook.remove()
    out["recoveries"] = [(r["step"], r["phase"], r["micro_batch_before"], r["micro_batch"], r["error"][:400])
                         for r in run.to_dict()["oom_recoveries"]]
    allocated = [r["allocated_mib"] for r in rows] or [0.0]
    out["after_steps"] = {"first": rows[:3], "last": rows[-1:], "allocated_min_max": [min(allocated), max(allocated)]}
    return out


def _figures() -> dict:
    stats = torch.cuda.memory_stats()
    return {"allocated_mib": round(torch.cuda.memory_allocated() / 2**20, 1),
            "peak_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1),
            "reserved_mib": round(torch.cuda.memory_reserved() / 2**20, 1),
            "segments": stats.get("segment.all.current"), "retries": stats.get("num_alloc_retries")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="same,same_gc,fresh")
    parser.add_argument("--batch", type=int, default=None, help="fresh: the size (default: the first same mode's answer)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--overrides", nargs="*", default=[])
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.overrides, args.batch, args.steps)))
        return
    batch = args.batch
    for mode in args.modes.split(","):
        command = [sys.executable, __file__, "--child", mode, "--steps", str(args.steps), "--overrides", *args.overrides]
        if batch is not None:
            command[2:2] = ["--batch", str(batch)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if not lines:
            print(mode, "failed:", done.stderr.strip().splitlines()[-3:], flush=True)
            continue
        row = json.loads(lines[-1])
        batch = batch if batch is not None else row["batch"]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
