"""Does a step that trains raise (and catch, inside a library) out-of-memory errors on a GPU?

    python scripts/diag_caught_ooms.py --workloads resnet50_tuned,resnet50,vit_b16,lstm

The decorator's warning for a function that caught its own out-of-memory errors reads the
allocator's ``num_ooms``. cuDNN's workspace search catches an allocation that fails inside
PyTorch (C++) and tries an algorithm that needs less: if that counts in ``num_ooms``, a step near
the wall that trained would look like a function that caught its errors. For each workload (bench
workloads of ``bench_promise.py``, an 8 GiB cap) the script runs the decorator over a plain step
(3 steps a call) and prints every attempt with its ``caught_ooms``, then trains 20 more steps at the
answer and prints how far ``num_ooms`` rose in steps that all trained.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_promise as bench  # noqa: E402
from autobatch import find_executable_batch_size  # noqa: E402

STARTS = {"resnet50": 512, "resnet50_tuned": 512, "vit_b16": 256, "lstm": 128, "gpt2": 16, "lm128k": 64}


def one(name: str, limit: int) -> None:
    model, optimizer, loss_fn, make, dtype, tuned = bench.build(name, "cuda", False)
    torch.backends.cudnn.benchmark = bool(tuned)
    step = bench.plain_step(model, optimizer, loss_fn, make, dtype, "cuda")

    @find_executable_batch_size(starting_batch_size=STARTS.get(name, 256))
    def train(batch_size: int) -> int:
        for _ in range(3):
            step(batch_size)
        return batch_size

    with bench.Capped("cuda", limit), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        answer = train()
        before = torch.cuda.memory_stats().get("num_ooms", 0)
        for _ in range(20):
            step(answer)
        torch.cuda.synchronize()
        after = torch.cuda.memory_stats().get("num_ooms", 0)
    attempts = [(a.batch_size, a.ok, a.caught_ooms) for a in train.attempts]
    warned = [str(w.message)[:90] for w in caught if "caught there" in str(w.message)]
    print(f"{name}: answer {answer}; attempts (size, ok, caught_ooms) {attempts}; "
          f"num_ooms rose {after - before} over 20 steps at the answer that all trained; warnings {warned}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="resnet50_tuned,resnet50,vit_b16,lstm")
    parser.add_argument("--memory-limit-gib", type=float, default=8.0)
    args = parser.parse_args()
    for name in args.workloads.split(","):
        one(name, int(args.memory_limit_gib * 2**30))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
