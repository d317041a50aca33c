"""A small training script on the Runner, for the SIGKILL-and-resume test.

    python tests/resume_worker.py CHECKPOINT_DIR OUT.pt LOG.jsonl [--resume] [--delay S]
    python tests/resume_worker.py WORK_DIR REPORT.json - --kill-at-random 20 --seed 0

The second form is the kill-at-random test: it imports torch once, then forks one child per
run. A reference child trains uninterrupted and counts the *moments* of its run (every phase
boundary of every step, and two points inside each checkpoint write: half the bytes written,
and just before the rename). For each of the ``--kill-at-random`` moments drawn with a
seeded RNG (a quarter of them inside a checkpoint write), a child trains and SIGKILLs
itself at that moment, then another child resumes from the checkpoint left behind (or starts
afresh if none was written yet) and trains to the end; its weights must equal the
reference's bit for bit. Writes REPORT.json.

Float64 MLP with dropout, Adam and a StepLR scheduler, a *shuffled* DataLoader (so resume
must reproduce the epoch's order and the random numbers), an injected OOM at step 4 (so the
checkpoint must carry the halved micro-batch). Checkpoints every step; appends one JSON line
per applied update (step, epoch, sample ids) to LOG; writes the final weights to OUT.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import random
import signal
import sys
import time
import traceback

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


class _Moments:
    """Counts the moments of a run; SIGKILLs this process at moment ``kill_at``."""

    def __init__(self) -> None:
        self.labels: list[str] = []
        self.kill_at: int | None = None

    def __call__(self, label: str) -> None:
        self.labels.append(label)
        if self.kill_at is not None and len(self.labels) == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def install(self) -> None:
        """Moments inside every checkpoint write: half the bytes, then before the rename."""
        save, replace = torch.save, os.replace

        def torn_save(obj, handle, *args, **kwargs):
            buffer = io.BytesIO()
            save(obj, buffer, *args, **kwargs)
            data = buffer.getvalue()
            handle.write(data[: len(data) // 2])
            handle.flush()
            self("write: half the bytes")
            handle.write(data[len(data) // 2 :])

        def replace_after_moment(src, dst):
            self("write: before the rename")
            replace(src, dst)

        # in this process only checkpoint_io.save_checkpoint calls these two
        torch.save, os.replace = torn_save, replace_after_moment


def _child(moments: _Moments, work: str, kill_at: int | None, out: str | None) -> int:
    """Fork a training run; return its wait status."""
    pid = os.fork()
    if pid:
        return os.waitpid(pid, 0)[1]
    code = 1
    try:
        moments.labels, moments.kill_at = [], kill_at
        runner, loader, _ = build(work)
        injector = runner.faults
        runner.faults = lambda step, phase: (moments(f"step {step} {phase}"), injector(step, phase))
        resume = work if os.path.exists(os.path.join(work, "last.pt")) else None
        result = runner.fit(loader, epochs=EPOCHS, resume=resume)
        if out is not None:
            with open(out, "wb") as handle:
                pickle.dump({"weights": [p.detach().numpy().tobytes() for p in runner.model.parameters()],
                             "labels": moments.labels, "steps": result.steps}, handle)
        code = 0
    except BaseException:  # noqa: BLE001 - a forked child reports and exits, never returns
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


def kill_at_random(work_dir: str, report: str, kills: int, seed: int) -> None:
    torch.set_num_threads(1)
    warm, loader, _ = build(os.path.join(work_dir, "warm-up"))
    warm.fit(loader, steps=1)  # lazy imports and first-use set-up once, not in every child
    moments = _Moments()
    moments.install()
    reference = os.path.join(work_dir, "reference.pkl")
    assert _child(moments, os.path.join(work_dir, "reference"), None, reference) == 0
    with open(reference, "rb") as handle:
        expected = pickle.load(handle)
    labels = expected["labels"]
    rng = random.Random(seed)
    writes = [i + 1 for i, label in enumerate(labels) if label.startswith("write")]
    others = [i + 1 for i, label in enumerate(labels) if not label.startswith("write")]
    chosen = sorted(rng.sample(writes, kills // 4) + rng.sample(others, kills - kills // 4))
    runs = []
    for n, moment in enumerate(chosen):
        work = os.path.join(work_dir, f"kill-{n}")
        killed = _child(moments, work, moment, None)
        out = os.path.join(work_dir, f"kill-{n}.pkl")
        resumed = _child(moments, work, None, out)
        got = None
        if resumed == 0:
            with open(out, "rb") as handle:
                got = pickle.load(handle)
        runs.append({
            "moment": moment, "label": labels[moment - 1],
            "killed": os.WIFSIGNALED(killed) and os.WTERMSIG(killed) == signal.SIGKILL,
            "checkpoint_left": os.path.exists(os.path.join(work, "last.pt")) or resumed != 0,
            "resumed_exit": resumed, "steps": None if got is None else got["steps"],
            "bit_equal": got is not None and got["weights"] == expected["weights"],
        })
    with open(report, "w") as handle:
        json.dump({"moments": len(labels), "steps": expected["steps"], "runs": runs}, handle, indent=1)


if __name__ == "__main__":
    if "--kill-at-random" in sys.argv:
        parser = argparse.ArgumentParser()
        parser.add_argument("work_dir")
        parser.add_argument("report")
        parser.add_argument("unused")
        parser.add_argument("--kill-at-random", type=int, required=True)
        parser.add_argument("--seed", type=int, default=0)
        options = parser.parse_args()
        kill_at_random(options.work_dir, options.report, options.kill_at_random, options.seed)
    else:
        main()
