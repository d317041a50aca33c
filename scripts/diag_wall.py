"""Where is the allocator's wall? (issue 16, diagnostics) A sweep of probe trials at many sizes,
in one fresh process per (workload, form), each trial as the probe runs it (cache emptied first,
``--steps`` steps), recording every figure a search could read: allocated and reserved peaks,
the last step's peak and resident memory, fragmentation, split bytes, and for a failure the
allocation that failed, the shortfall and the wall.

    python scripts/diag_wall.py --workloads vit_b16,resnet50 --sizes vit_b16=8,60,85,95:107
    python scripts/diag_wall.py --device cpu --quick --workloads vit_b16 --sizes vit_b16=2,4

Sizes: comma-separated, ``a:b`` for every size from a to b-1. Trials run in the order given,
so a sweep that climbs shows what a search that climbs sees.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import autobatch  # noqa: E402
from autobatch.memory.devices import memory_for, resolve_device  # noqa: E402
from autobatch.memory.oom import requested_bytes  # noqa: E402
from autobatch.probe.searching.search import peak_limit  # noqa: E402
from autobatch.probe.trial import TrialRunner  # noqa: E402
from bench_promise import build, plain_step, warm_up  # noqa: E402


def sizes_of(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        if ":" in part:
            a, b = part.split(":")
            out.extend(range(int(a), int(b)))
        else:
            out.append(int(part))
    return out


def sweep(args) -> list[dict]:
    """Every size's trial in this process."""
    name, device = args.child, resolve_device(args.device)
    torch.backends.cudnn.benchmark = name.endswith("_tuned")
    warm_up(name, args.device, args.quick)
    model, optimizer, loss_fn, make, dtype, _ = build(name, args.device, args.quick)
    if args.form == "trainstep":
        fn = autobatch.TrainStep(model, optimizer, loss_fn, make, autocast_dtype=dtype)
        clear = fn.clear_grads
    else:
        fn = plain_step(model, optimizer, loss_fn, make, dtype, args.device)
        clear = lambda: [setattr(p, "grad", None) for p in model.parameters()]  # noqa: E731
    rows = []
    # the CPU: a simulated budget of that size; an accelerator: the process capped at it
    with memory_for(device, autobatch.parse_bytes(args.memory_limit)) as (memory, _):
        runner = TrialRunner(fn, memory, args.steps, after_oom=clear,
                             peak_limit=peak_limit(memory, memory.capacity()), settle_final=args.device != "cpu")
        for size in sizes_of(args.sizes[-1]):
            record = runner.run(size, "diag", steps=args.steps)
            row = {k: v for k, v in record.to_dict().items() if k != "error"}
            row["requested"] = requested_bytes(record.error) if record.error else None
            row["error"] = (record.error or "")[:120]
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="vit_b16,resnet50")
    parser.add_argument("--forms", default="trainstep,plain")
    parser.add_argument("--sizes", action="append", default=[], help="workload=sizes (see the module's doc)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--memory-limit", default="8GiB")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--form", help=argparse.SUPPRESS)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(sweep(args), default=str))
        return
    wanted = dict(item.split("=", 1) for item in args.sizes)
    results = {}
    for name in args.workloads.split(","):
        for form in args.forms.split(","):
            command = [sys.executable, __file__, "--child", name, "--form", form, "--sizes", wanted.get(name, "8,16"),
                       "--steps", str(args.steps), "--device", args.device, "--memory-limit", args.memory_limit]
            if args.quick:
                command.append("--quick")
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                results[f"{name}/{form}"] = {"error": done.stderr.strip().splitlines()[-3:]}
                print(name, form, results[f"{name}/{form}"], flush=True)
                continue
            rows = json.loads(done.stdout.strip().splitlines()[-1])
            results[f"{name}/{form}"] = rows
            print(f"== {name} {form}", flush=True)
            for r in rows:
                mib = lambda v: "-" if v is None else f"{v / 2**20:.0f}"  # noqa: E731
                print(f"{r['batch_size']:5d} {'ok ' if r['passed'] else 'OOM'} {r['seconds']:.3f}s peak {mib(r['peak_bytes'])} "
                      f"res {mib(r['reserved_bytes'])} step {mib(r['step_peak_bytes'])} resident {mib(r['resident_bytes'])} "
                      f"frag {mib(r['fragmentation_bytes'])} split {mib(r['inactive_split_bytes'])} over {mib(r['over_bytes'])} "
                      f"wall {mib(r['wall_bytes'])} req {mib(r['requested'])} {r['error'][:60]}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
