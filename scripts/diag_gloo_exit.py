"""Does a finished two-rank gloo run exit cleanly? (CI flake, November 2026)

A CI run failed one torchrun test: both ranks trained, wrote their results, and then rank 1
aborted at exit (``terminate called without an active exception``, SIGABRT), so torchrun
reported the finished run as failed. ``autobatch.dist.joining._leave_at_exit`` destroys the
process group at exit; the abort came after that destroy, in the interpreter's teardown.

This script launches a tiny DDP job (three steps of a linear layer kept alive to the end, one
rank lingering up to 50 ms, as one rank finishing first does) ``--runs`` times under
``torch.distributed.run`` and counts the launches that fail. ``--handler`` picks what runs at
exit:

* ``leave``: autobatch's ``_leave_at_exit`` (as ``python -m autobatch train`` under torchrun);
* ``destroy``: ``dist.destroy_process_group()`` alone (the handler before the fix);
* ``barrier``: a barrier, then the destroy (the fix other projects use).

    python scripts/diag_gloo_exit.py --handler destroy --runs 70 --slow-rank 0
    python scripts/diag_gloo_exit.py --handler leave --runs 70 --slow-rank 0

Measured on this project's 2-core CPU machine (torch 2.13.0+cpu), four launch loops at once:
``destroy`` 32 failed of 490, ``barrier`` 4 of 80, ``leave`` (a garbage collection before
and after the destroy) 0 of 320.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: the model and optimizer, alive until the interpreter's teardown, as a script's globals are
#: (a local one, freed before the exit handlers run, never aborted: 0 of 120 with ``destroy``)
KEEP: list = []


def worker(handler: str, slow_rank: int) -> None:
    """One rank: join through ``init_from_env``, swap in the handler asked for, train, linger."""
    import atexit

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from autobatch.dist.joining import _leave_at_exit, init_from_env

    init_from_env("cpu")
    if handler != "leave":
        atexit.unregister(_leave_at_exit)

        def leave() -> None:
            if handler == "barrier":
                dist.barrier()
            dist.destroy_process_group()

        atexit.register(leave)
    model = DistributedDataParallel(torch.nn.Linear(16, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(4, 16)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    KEEP.extend([model, optimizer])
    if dist.get_rank() == slow_rank:
        time.sleep(random.random() * 0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--handler", choices=["leave", "destroy", "barrier"], default="leave")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--slow-rank", type=int, choices=[0, 1], default=0, help="the rank that lingers at the end")
    parser.add_argument("--port", type=int, default=29650)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.handler, args.slow_rank)
        return
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(args.port),
               __file__, "--worker", "--handler", args.handler, "--slow-rank", str(args.slow_rank)]  # fmt: skip
    failed = 0
    for _ in range(args.runs):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            failed += 1
            aborted = "terminate called without an active exception" in done.stderr
            print(f"failed (rc {done.returncode}{', abort at exit' if aborted else ''})", flush=True)
    print(f"handler {args.handler}, slow rank {args.slow_rank}: {failed} of {args.runs} launches failed")


if __name__ == "__main__":
    main()
