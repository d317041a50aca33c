"""What does the zero-lr check of a TrainStep's weights cost? (issue 16, diagnostics)

``autobatch.probe.snapshot.restore.steps_in_place_at_zero_lr`` reads every weight once (finite, no
negative zero) before a probe's first trial. Each variant below runs in a fresh process after
bench_promise's warm-up, timed twice: the first call pays for loading the kernels it uses
(CUDA loads a kernel on its first launch), the second is what the work itself costs.

    python scripts/diag_zero_lr_check.py                      (GPU; about two minutes)
    python scripts/diag_zero_lr_check.py --workloads vit_b16 --variants current,norm

Variants: ``current`` (the check as the probe runs it: an integer view's minimum per tensor, a
negative zero's bits being the type's smallest integer, and one fused norm, the verdict read on
the host), ``five`` (the check before it: the integer view compared with the sign bit and
``any`` per tensor, the fused norm, the verdict reduced on the device), ``eq_any`` (negative
zeros only, as ``five``), ``norm`` (non-finite only: one fused norm), ``signbit`` (negative
zeros through ``signbit`` and ``== 0``), ``cpu`` (copying the weights to host memory instead,
what a snapshot without zero lr pays).
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

VARIANTS = ("current", "five", "eq_any", "norm", "signbit", "cpu")


def _run(variant: str, params: list[torch.Tensor], optimizer) -> None:
    from autobatch.probe.snapshot.restore import _NEGATIVE_ZERO, steps_in_place_at_zero_lr

    if variant == "current":
        steps_in_place_at_zero_lr(optimizer)
    elif variant == "eq_any":
        kind, bits = _NEGATIVE_ZERO[params[0].dtype]
        bool(torch.stack([w.view(kind).eq(bits).any() for w in params]).any())
    elif variant == "norm":
        bool(torch.stack(torch._foreach_norm(params, 2)).isfinite().all())
    elif variant == "signbit":
        bool(torch.stack([torch.signbit(w).logical_and_(w == 0).any() for w in params]).any())
    elif variant == "five":
        kind, bits = _NEGATIVE_ZERO[params[0].dtype]
        negative_zero = torch.stack([w.view(kind).eq(bits).any() for w in params]).any()
        norms = torch.stack(torch._foreach_norm(params, 2))
        bool(negative_zero | ~norms.isfinite().all())
    elif variant == "cpu":
        [w.to("cpu") for w in params]


def child(name: str, variant: str, device: str) -> dict:
    from bench_promise import build, warm_up

    warm_up(name, device, False)
    model, optimizer, *_ = build(name, device, False)
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    began = time.perf_counter()
    synchronize()
    out = {"queued_before_s": time.perf_counter() - began}
    params = [p.detach() for group in optimizer.param_groups for p in group["params"]]
    for call in range(2):
        began = time.perf_counter()
        _run(variant, params, optimizer)
        synchronize()
        out[f"call{call}_s"] = round(time.perf_counter() - began, 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="vit_b16,resnet50")
    parser.add_argument("--variants", default="current," + ",".join(VARIANTS))  # current twice: its spread
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.device)))
        return
    for name in args.workloads.split(","):
        for variant in args.variants.split(","):
            done = subprocess.run([sys.executable, __file__, "--child", name, variant, "--device", args.device],
                                  capture_output=True, text=True)
            print(name, variant, done.stdout.strip()[-200:] or done.stderr.strip()[-300:], flush=True)


if __name__ == "__main__":
    main()
