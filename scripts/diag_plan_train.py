"""Does a plan that needs activation checkpointing train where it was planned? (the Plan pillar on a GPU)

For each ``--caps`` value, in new processes through the command line: ``probe`` plans
``train.global_batch`` for a GPT whose batch 1 may not fit under the cap (so the plan may turn on
activation checkpointing), then ``train`` reads that plan from the cache in a new process and
trains ``--steps`` steps; ``--same`` also trains with ``probe.cache=false`` (plan and train in one
process). One table row per run: the plan (micro-batch x accumulation, checkpointing), the probe's
time, and the training's steps, recoveries and samples/s.

    python scripts/diag_plan_train.py --caps 3GiB,3.5GiB,4GiB --steps 50 --same
    python scripts/diag_plan_train.py --device cpu --caps 2MiB --steps 2 \
        --overrides model.layers=6 model.width=32 data.seq_len=256 data.vocab_size=32   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: A GPT-2-medium-wide decoder at 2048 tokens: about 168M parameters (AdamW: 2.7 GB of state),
#: 1.1 GB of activations per sample plain, a third of that checkpointed.
GPU_MODEL = ["model=gpt", "model.layers=12", "model.width=1024", "model.heads=16", "data.seq_len=2048",
             "data.vocab_size=8192", "precision=bf16"]


def cli(command: str, overrides: list[str], cwd: Path) -> tuple[int, float, str]:
    """Run ``python -m autobatch <command> <overrides>`` in ``cwd``: (exit code, seconds, output tail)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "autobatch", command, *overrides], cwd=cwd, env=env,
                          capture_output=True, text=True)
    return done.returncode, time.perf_counter() - began, (done.stdout + done.stderr)[-1500:]


def newest(cwd: Path, command: str, name: str) -> dict | None:
    """The newest run directory's ``name`` (result.json, train_result.json), or None."""
    found = sorted((cwd / "outputs" / command).glob(f"*/*/{name}"), key=lambda p: p.stat().st_mtime)
    return json.loads(found[-1].read_text()) if found else None


def plan_text(plan: dict | None) -> str:
    if not plan:
        return "-"
    sizes = plan.get("micro_batch_sizes") or []
    checkpointed = f", checkpointing {len(plan.get('checkpointed_modules') or [])} blocks" if plan.get("checkpointing") else ""
    return f"{plan['micro_batch']} x {len(sizes) or plan.get('accumulation_steps')}{checkpointed}"


def one_cap(cap: str, args: argparse.Namespace, cwd: Path) -> list[dict]:
    base = [*args.model, *args.overrides, f"device={args.device}", f"probe.memory_limit={cap}",
            f"train.global_batch={args.global_batch}", f"probe.cache_dir={cwd / 'cache'}"]
    rows = []
    rc, seconds, tail = cli("probe", base, cwd)
    plan = newest(cwd, "probe", "plan.json") if rc == 0 else None
    rows.append(dict(cap=cap, run="probe", rc=rc, seconds=round(seconds, 1), plan=plan_text(plan),
                     reason=(plan or {}).get("reason"), tail=None if rc == 0 else tail[-600:]))
    runs = [("train, new process (cache)", [])] + ([("train, planned in its process", ["probe.cache=false"])] if args.same else [])
    for label, extra in runs:
        rc, seconds, tail = cli("train", [*base, f"train.steps={args.steps}", *extra], cwd)
        done = newest(cwd, "train", "train_result.json") if rc == 0 else None
        row = dict(cap=cap, run=label, rc=rc, seconds=round(seconds, 1), tail=None if rc == 0 else tail[-600:])
        if done:
            row.update(plan=plan_text(done.get("plan")), steps=done["steps"], recoveries=len(done["oom_recoveries"]),
                       micro_batch=f"{done['initial_micro_batch']} -> {done['micro_batch']}",
                       samples_per_s=round(done["samples"] / max(done["elapsed_s"], 1e-9), 1))
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--caps", default="3GiB,3.5GiB,4GiB")
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--same", action="store_true", help="also plan and train in one process")
    parser.add_argument("--overrides", nargs="*", default=[], help="more command-line overrides")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.model = GPU_MODEL if args.device == "cuda" else ["model=gpt"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for cap in args.caps.split(","):
            for row in one_cap(cap, args, Path(tmp)):
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("\n| cap | run | plan | steps | recoveries | micro-batch | samples/s | s |\n| --- | --- | --- | ---: | ---: | --- | ---: | ---: |")
    for r in rows:
        print(f"| {r['cap']} | {r['run']} | {r.get('plan', '-')} | {r.get('steps', '-')} | {r.get('recoveries', '-')} | "
              f"{r.get('micro_batch', '-')} | {r.get('samples_per_s', '-')} | {r['seconds']} |" + ("" if r["rc"] == 0 else f" rc {r['rc']}"))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
