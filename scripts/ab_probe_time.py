"""Probe time of two (or more) versions of autobatch side by side with Accelerate (issue 16).

Each probe runs in its own fresh process (``bench_promise.py --child NAME --form time_trainstep``
of that version), the versions and Accelerate interleaved and their order rotated per round,
so machine drift and order bias fall on all of them alike. A version is a directory holding
``autobatch/`` and ``scripts/``, e.g. an export of a commit:

    mkdir -p /tmp/v0 && git archive HEAD~1 autobatch scripts | tar -x -C /tmp/v0
    python scripts/ab_probe_time.py --versions /tmp/v0,. --rounds 4 --workloads resnet50,vit_b16

Prints each run's answer and seconds (the first round with its trial log) and each column's
median; ``--out`` writes every run as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

EXACT = {"resnet50": 180, "resnet50_tuned": 180, "vit_b16": 99, "gpt2": 5, "llama": 5,  # H200, 8 GiB cap
         "clip": 125, "fasterrcnn": 22, "vae": 1532, "unet": 158, "segformer": 6, "whisper": 24}


def run(version: Path, name: str, form: str, start: int, memory_limit: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(version), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, str(version / "scripts" / "bench_promise.py"), "--child", name, "--form", f"time_{form}",
               "--batch", str(start), "--device", "cuda", "--memory-limit", memory_limit]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": done.stderr.strip()[-500:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", required=True, help="comma-separated directories with autobatch/ and scripts/")
    parser.add_argument("--workloads", default="resnet50,vit_b16")
    parser.add_argument("--form", default="trainstep", choices=("trainstep", "plain"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-limit", default="8GiB")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    versions = [Path(v).resolve() for v in args.versions.split(",")]
    columns = [(v, args.form) for v in versions] + [(versions[0], "accelerate")]
    out: dict = {}
    for name in args.workloads.split(","):
        start = 2 ** math.ceil(math.log2(EXACT.get(name, 100) * 1.05))  # Accelerate's start, as bench_promise's
        runs: dict = {f"{v}:{f}": [] for v, f in columns}
        for round_ in range(args.rounds):
            for version, form in columns[round_ % len(columns):] + columns[:round_ % len(columns)]:
                row = run(version, name, form, start, args.memory_limit)
                runs[f"{version}:{form}"].append(row)
                trials = [t[:5] for t in row.get("trials", [])] if round_ == 0 else ""
                print(name, version, form, row.get("batch"), row.get("seconds"), trials, row.get("error", ""), flush=True)
        for column, rows in runs.items():
            seconds = [r["seconds"] for r in rows if "seconds" in r]
            print(f"== {name} {column}: median {statistics.median(seconds) if seconds else None} s, all {seconds}, "
                  f"answers {[r.get('batch') for r in rows]}", flush=True)
        out[name] = runs
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
