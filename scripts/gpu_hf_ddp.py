"""``fit_batch_size`` over several processes: does its answer train in the DDP ``train()`` wraps?

Run under ``torchrun`` (one process per GPU). Every rank builds the same ``transformers.Trainer``
(GPT-2 small from its config, no download, packed samples of ``--tokens`` tokens, bf16) under
the per-process cap ``--memory-limit``, then:

1. ``fit_batch_size(trainer)`` as shipped (over CPU processes each trial holds a stand-in for
   DDP's gradient buckets; over GPU processes none), and ``train()`` at its answer for
   ``--steps`` steps, with its allocated peak;
2. the same with any stand-in switched off (the unwrapped model's trials alone);
3. ``train()`` one size above each answer (is it the exact maximum under DDP?).

Rank 0 prints one JSON line per run and writes them to ``--out``:

    torchrun --nproc-per-node 2 scripts/gpu_hf_ddp.py --memory-limit 12GiB --out hf_ddp.json
    torchrun --nproc-per-node 2 scripts/gpu_hf_ddp.py --device cpu --quick   # gloo, simulated memory
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import transformers  # noqa: E402
from bench_transformers import PadCollator, capped, make_trainer, release, train, workload as bench_workload  # noqa: E402

from autobatch.integrations import transformers_step  # noqa: E402
from autobatch.integrations.transformers import fit_batch_size  # noqa: E402


def spec(tokens: int, quick: bool):
    """(model factory, training set, collator, global batch), as ``bench_transformers.workload``."""
    config = (transformers.GPT2Config(vocab_size=512, n_positions=tokens, n_embd=256, n_layer=2, n_head=2) if quick
              else transformers.GPT2Config(n_positions=tokens))
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, config.vocab_size, (tokens,), generator=generator)} for _ in range(4096)]
    return (lambda: transformers.GPT2LMHeadModel(config)), data, PadCollator(), None


def probe_and_train(workload, args, *, stand_in: bool) -> dict:
    """``fit_batch_size`` (with or without the bucket stand-in), then ``train()`` at its answer."""
    shipped = transformers_step.ddp_bucket_bytes
    if not stand_in:
        transformers_step.ddp_bucket_bytes = lambda trainer: 0
    try:
        with capped(args.device, args.memory_limit):
            trainer, watch = make_trainer(workload, args.device, args.tmp, args.steps, args.quick,
                                          per_device_train_batch_size=1, **args.trainer_options)
            began = time.perf_counter()
            result = fit_batch_size(trainer, cache=False)
            seconds = time.perf_counter() - began
            bucket_bytes = transformers_step.ddp_bucket_bytes(trainer)
            trained = peak_of(train, trainer)
            row = {"stand_in": stand_in, "bucket_bytes": bucket_bytes, "answer": result.batch_size,
                   "probe_seconds": round(seconds, 2), "steps_trained": sum(a["steps"] for a in watch.attempts),
                   "wrapped": type(trainer.model_wrapped).__name__, **trained,
                   "trials": [[t.batch_size, t.passed, t.steps, _mib(t.peak_bytes), _mib(t.step_peak_bytes),
                               _mib(t.resident_bytes)] for t in result.trials]}
            release(trainer)
    finally:
        transformers_step.ddp_bucket_bytes = shipped
    return row


def train_at(workload, args, size: int) -> dict:
    """``train()`` of a fresh trainer at per-device ``size`` under the cap."""
    with capped(args.device, args.memory_limit):
        trainer, watch = make_trainer(workload, args.device, args.tmp, args.steps, args.quick,
                                      per_device_train_batch_size=size, **args.trainer_options)
        row = {"batch": size, **peak_of(train, trainer)}
        row["steps_trained"] = sum(a["steps"] for a in watch.attempts)
        release(trainer)
    return row


def _mib(value) -> float | None:
    return None if value is None else round(value / 2**20, 1)


def peak_of(run, trainer) -> dict:
    """``run(trainer)``'s report with the allocated peak of the run (CUDA; MiB)."""
    if torch.cuda.is_available() and trainer.args.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    report = run(trainer)
    if torch.cuda.is_available() and trainer.args.device.type == "cuda":
        report["peak_mib"] = _mib(torch.cuda.max_memory_allocated())
    return report


def agreed_oom(row: dict) -> bool:
    """Whether any rank's run ended in an out-of-memory error."""
    flag = torch.tensor([row.get("oom") is not None], dtype=torch.int32,
                        device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--memory-limit", default=None, help="per-process cap (default 12GiB on CUDA, 64MiB on the CPU)")
    parser.add_argument("--workload", choices=["gpt2", "vit"], default="gpt2",
                        help="gpt2: GPT-2 small on --tokens tokens; vit: bench_transformers.py's ViT-B/16")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sample (gpt2)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="a tiny GPT-2 (CPU smoke run)")
    parser.add_argument("--find-unused", choices=["default", "false"], default="default",
                        help="TrainingArguments.ddp_find_unused_parameters (default: the Trainer's, True without "
                             "checkpointing)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.trainer_options = {} if args.find_unused == "default" else {"ddp_find_unused_parameters": False}
    args.memory_limit = args.memory_limit or ("64MiB" if args.device == "cpu" else "12GiB")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    workload = spec(args.tokens, args.quick) if args.workload == "gpt2" else bench_workload("vit", args.quick)
    rows = []
    with tempfile.TemporaryDirectory() as args.tmp:
        warm, _ = make_trainer(workload, args.device, args.tmp, 2, args.quick, per_device_train_batch_size=1)
        train(warm)  # the process's first kernels, and the process group, before anything is timed
        release(warm)
        rank = dist.get_rank()
        env = {"device": torch.cuda.get_device_name() if args.device != "cpu" else "cpu", "world": dist.get_world_size(),
               "torch": torch.__version__, "transformers": transformers.__version__, "memory_limit": args.memory_limit,
               "workload": args.workload, "tokens": args.tokens, "find_unused": args.find_unused}
        for stand_in in (True, False):
            row = probe_and_train(workload, args, stand_in=stand_in)
            row["any_rank_oom"] = agreed_oom(row)
            rows.append(row)
        for size in sorted({rows[0]["answer"] + 1, rows[1]["answer"] + 1} - {rows[1]["answer"]}):
            above = train_at(workload, args, size)
            above["any_rank_oom"] = agreed_oom(above)
            rows.append(above)
    if rank == 0:
        print(json.dumps(env))
        for row in rows:
            print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "w") as handle:
                json.dump({"env": env, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
