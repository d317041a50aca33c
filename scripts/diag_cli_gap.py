"""Why does the CLI's probe answer less than the library's on the same workload? (issue 16)

On an H200 (8 GiB cap) the CLI answered 4 for the Llama-style decoder where the library's
``TrainStep`` answered 5: the same trial sequence (8 OOM, 4, 6 OOM, 5), but 5 failed in the CLI
with 0.79 GiB of the cap free in pieces too small. Each variant below probes in a fresh process
and prints its trials, so one device call tells which difference matters:

* ``build``: ``bench`` (bench_promise's model, optimizer, loss and batches) or ``cli`` (the
  objects ``python -m autobatch probe`` builds from the same spelling, through Hydra);
* ``warm``: ``none`` (the probe first thing in the process, as the CLI runs it) or ``steps``
  (bench_promise's warm-up first: two steps of a throwaway copy, which also makes cuBLAS
  allocate its workspaces before any trial).

Measured (H200, 8 GiB cap, one process per row): Llama answered 5 in five of six rows and 4 in
one (bench build, a cuBLAS warm-up since removed), with the same trials up to 5; the CLI build
answered 5 with and without a warm-up. So the CLI's 4 was not the CLI: 5 sits at the
allocator's wall and passes in some processes, not in others (the bench's exact maximum, found
in-process, was 5 in earlier runs and 4 in this one). ViT-B/16 took the same eight trials in
every row.

    python scripts/diag_cli_gap.py --workloads llama,vit_b16 --out gap.json
    python scripts/diag_cli_gap.py --device cpu --quick --workloads gpt2     (proves it runs)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import autobatch  # noqa: E402
from bench_promise import build, cli_overrides, warm_up  # noqa: E402

BUILDS = ("bench", "cli")
WARMS = ("none", "steps")


def cli_step(args, name: str):
    """The CLI's probe step and probe arguments for ``name``, composed as the CLI composes them."""
    from hydra import compose, initialize_config_module

    from autobatch.cli.build import build_workload
    from autobatch.cli.commands import probe_kwargs
    from autobatch.cli.conf import ensure_conf_module

    overrides = [*cli_overrides(args, name), f"device.type={args.device}", "probe.cache=false"]
    if args.memory_limit:
        overrides.append(f"probe.memory_limit={args.memory_limit}")
    with initialize_config_module(ensure_conf_module(), version_base=None):
        cfg = compose("probe", overrides)
    workload = build_workload(cfg)
    return workload.probe_step, probe_kwargs(cfg, workload)


def child(args) -> dict:
    name, how, warm = args.child, args.build, args.warm
    if warm == "steps":
        warm_up(name, args.device, args.quick)
    if how == "cli":
        step, kwargs = cli_step(args, name)
    else:
        torch.backends.cudnn.benchmark = name.endswith("_tuned")
        model, optimizer, loss_fn, make, dtype, _ = build(name, args.device, args.quick)
        step = autobatch.TrainStep(model, optimizer, loss_fn, make, autocast_dtype=dtype)
        kwargs = dict(memory_limit=args.memory_limit, device=args.device, cache=False)
    began = time.perf_counter()
    result = autobatch.find_max_batch(step, **kwargs)
    seconds = time.perf_counter() - began
    return {
        "workload": name, "build": how, "warm": warm, "answer": result.batch_size, "seconds": round(seconds, 3),
        "trials": [(t.batch_size, t.passed, t.purpose, None if t.wall_bytes is None else round(t.wall_bytes / 2**20))
                   for t in result.trials],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--memory-limit", default=None, help="default 8GiB on CUDA, 16MiB on the CPU")
    parser.add_argument("--workloads", default="llama,vit_b16")
    parser.add_argument("--builds", default=",".join(BUILDS))
    parser.add_argument("--warms", default=",".join(WARMS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--build", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--warm", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.memory_limit = args.memory_limit or ("8GiB" if args.device == "cuda" else "16MiB")
    if args.child:
        print(json.dumps(child(args)))
        return
    rows = []
    for name in args.workloads.split(","):
        for how in args.builds.split(","):
            for warm in args.warms.split(","):
                command = [sys.executable, __file__, "--child", name, "--build", how, "--warm", warm,
                           "--device", args.device, "--memory-limit", args.memory_limit, *(["--quick"] if args.quick else [])]
                done = subprocess.run(command, capture_output=True, text=True, timeout=600)
                row = (json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else
                       {"workload": name, "build": how, "warm": warm, "error": done.stderr.strip().splitlines()[-3:]})
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
