"""A small training script on the Runner, for the SIGKILL-and-resume test.

    python tests/resume_worker.py CHECKPOINT_DIR OUT.pt LOG.jsonl [--resume] [--delay S]

Float64 MLP with dropout, Adam and a StepLR scheduler, a *shuffled* DataLoader (so resume
must reproduce the epoch's order and the random numbers), an injected OOM at step 4 (so the
checkpoint must carry the halved micro-batch). Checkpoints every step; appends one JSON line
per applied update (step, epoch, sample ids) to LOG; writes the final weights to OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset, default_collate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from autobatch import FaultInjector, Runner  # noqa: E402
from runner_workloads import FEATURES, SampleTracker, make_model  # noqa: E402

SAMPLES, GLOBAL, MICRO, EPOCHS = 96, 16, 8, 3
TOTAL_STEPS = SAMPLES // GLOBAL * EPOCHS


def with_positions(items):
    """Collate, then add each sample's position in its global batch (for the tracker)."""
    batch = default_collate(items)
    return (*batch, torch.arange(len(items)))


def build(checkpoint_dir: str, log_path: str | None = None, delay: float = 0.0):
    torch.manual_seed(0)
    model = make_model(dropout=0.1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, FEATURES, generator=generator, dtype=torch.float64)
    y = torch.randn(SAMPLES, 1, generator=generator, dtype=torch.float64)
    loader = DataLoader(TensorDataset(x, y, torch.arange(SAMPLES)), batch_size=GLOBAL, shuffle=True,
                        collate_fn=with_positions)
    tracker = SampleTracker(optimizer, GLOBAL)
    runner = Runner(model, optimizer, tracker.loss_fn, global_batch=GLOBAL, micro_batch=MICRO, scheduler=scheduler,
                    checkpoint_dir=checkpoint_dir, checkpoint_every=1, progress=False,
                    faults=FaultInjector((4, "backward")))

    def on_step_end(info):
        if log_path is not None:
            with open(log_path, "a") as handle:
                handle.write(json.dumps({"step": info["step"], "epoch": info["epoch"], "ids": tracker.applied[-1]}) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
        time.sleep(delay)

    return runner, loader, on_step_end


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint_dir")
    parser.add_argument("out")
    parser.add_argument("log")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--delay", type=float, default=0.0)
    args = parser.parse_args(argv)
    runner, loader, on_step_end = build(args.checkpoint_dir, args.log, args.delay)
    result = runner.fit(loader, epochs=EPOCHS, resume=args.checkpoint_dir if args.resume else None, on_step_end=on_step_end)
    torch.save({"weights": [p.detach() for p in runner.model.parameters()], "result": result.to_dict()}, args.out)


if __name__ == "__main__":
    main()
