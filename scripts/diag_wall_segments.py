"""What pins the allocator's segments between probe trials, at the allocator's wall? (issue 16, diagnostics)

On an H200 (8 GiB cap) the CLI's probe of the Llama-style decoder answered 4 in two of three
device calls, where the library's ``TrainStep`` and plain callable answered 5 in every call
and trained 200 steps at 5 in new processes. In the CLI's process 6 and 5 failed *at the
wall* (allocated plus the request under the limit, 0.38 and 0.82 GiB held in free pieces),
where in the library's 6 failed over the limit and 5 passed.

Each run probes once in a new process and records, as each trial starts (after the last one's
clean-up) and as it ends, the allocator's segments that hold a live block: those cannot be
returned to the driver, so their free pieces are what a later trial's large requests cannot
use. ``--build cli`` runs ``python -m autobatch probe`` in that process (the CLI's own path,
Hydra and all); ``--build bench`` probes ``bench_promise``'s ``TrainStep`` of the same
workload, after its warm-up or (``--no-warm``) without one, as the CLI runs.

    python scripts/diag_wall_segments.py --builds cli,bench --repeat 2 --workload llama
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import autobatch  # noqa: E402
from autobatch.probe.records import watch_trials  # noqa: E402

MiB = 2**20


def pinned_segments() -> dict:
    """Segments holding a live block: (segment MiB, live MiB, the largest live blocks in MiB)."""
    rows, reserved = [], 0
    for segment in torch.cuda.memory_snapshot():
        reserved += segment["total_size"]
        live = [b["size"] for b in segment["blocks"] if b["state"] == "active_allocated"]
        if live and segment["total_size"] > 2 * MiB:
            rows.append((round(segment["total_size"] / MiB, 1), round(sum(live) / MiB, 1),
                         [round(s / MiB, 2) for s in sorted(live, reverse=True)[:4]]))
    return {"reserved_mib": round(reserved / MiB, 1), "allocated_mib": round(torch.cuda.memory_allocated() / MiB, 1),
            "pinned": sorted(rows, reverse=True)[:12]}


def child(args) -> None:
    log: list[dict] = []

    def watch(batch_size: int, purpose: str, record) -> None:
        entry = {"batch": batch_size, "purpose": purpose, "at": "start" if record is None else "end", **pinned_segments()}
        if record is not None:
            entry.update(passed=record.passed, wall_mib=None if record.wall_bytes is None else round(record.wall_bytes / MiB, 1),
                         error=(record.error or "")[:160])
        log.append(entry)

    with watch_trials(watch):
        if args.build == "cli":
            from bench_promise import cli_overrides

            from autobatch.__main__ import main

            with tempfile.TemporaryDirectory() as tmp:
                overrides = [*cli_overrides(args, args.workload), "device.type=cuda", f"probe.memory_limit={args.memory_limit}",
                             "probe.cache=false", f"hydra.run.dir={tmp}/run"]
                try:
                    main(["probe", *overrides])
                except SystemExit:  # Hydra's app may exit once it has written its result
                    pass
        else:
            from bench_promise import build, warm_up

            if args.warm:
                warm_up(args.workload, "cuda", False)
            model, optimizer, loss_fn, make, dtype, _ = build(args.workload, "cuda", False)
            step = autobatch.TrainStep(model, optimizer, loss_fn, make, autocast_dtype=dtype)
            autobatch.find_max_batch(step, memory_limit=args.memory_limit, device="cuda", cache=False)
    print("JSON " + json.dumps(log))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="llama")
    parser.add_argument("--builds", default="cli,bench")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--memory-limit", default="8GiB")
    parser.add_argument("--warm", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--build", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.device, args.quick = "cuda", False  # what bench_promise's cli_overrides reads
    if args.build:
        return child(args)
    for build in args.builds.split(","):
        for _ in range(args.repeat):
            done = subprocess.run([sys.executable, __file__, "--build", build, "--workload", args.workload, "--memory-limit",
                                   args.memory_limit, "--warm" if args.warm else "--no-warm"],
                                  capture_output=True, text=True, timeout=300)
            lines = [line[5:] for line in done.stdout.splitlines() if line.startswith("JSON ")]
            if not lines:
                print(json.dumps({"build": build, "error": done.stderr[-800:]}), flush=True)
                continue
            for entry in json.loads(lines[-1]):
                print(json.dumps({"build": build, **entry}), flush=True)
            print(flush=True)


if __name__ == "__main__":
    main()
