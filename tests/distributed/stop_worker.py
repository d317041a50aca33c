"""One rank of ``test_stop_ranks.py`` (gloo, CPU): a stop asked for on one rank ends every rank.

Run as ``python tests/distributed/stop_worker.py SCENARIO[,SCENARIO...] OUT_DIR`` with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set; start-up, reports and teardown:
``rank_worker.py``. Each scenario (a plain module, DDP, FSDP2) trains two epochs three ways:
uninterrupted; with ``runner.request_stop()`` called on rank 1 alone after its third step
(checkpoint written); and resumed from that checkpoint by a new runner. It reports the step each
rank ended at, ``result.stopped``, and whether the resumed run's weights equal the
uninterrupted run's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent), str(HERE)]

from autobatch import Runner  # noqa: E402
from lockstep_worker import _batches, _model, _mse  # noqa: E402
from rank_worker import main  # noqa: E402

QUIET = dict(grow_after=None, progress=False, log_every=None)
ASKED_AT = 3  # rank 1 asks after this step


def _weights(model: nn.Module) -> torch.Tensor:
    """This rank's parameters (an FSDP2 rank's own shards), flattened."""
    return torch.cat([getattr(p, "_local_tensor", p).detach().reshape(-1) for p in model.parameters()])


def _runner(kind: str, **options) -> Runner:
    model = _model(kind)
    return Runner(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _mse, global_batch=16, micro_batch=4,
                  **QUIET, **options)


def _stop(rank: int, kind: str, out: Path) -> dict:
    data = _batches(128, 16, rank, 2)  # 8 steps an epoch
    reference = _runner(kind)
    reference.fit(data, epochs=2)
    stopping = _runner(kind, checkpoint_dir=out / kind)

    def on_step_end(info):
        if rank == 1 and info["step"] == ASKED_AT:
            stopping.request_stop()

    stopped = stopping.fit(data, epochs=2, on_step_end=on_step_end)
    resumed = _runner(kind)
    finished = resumed.fit(data, epochs=2, resume=out / kind)
    return {"stopped": stopped.stopped, "stopped_at": stopped.steps, "checkpoint_step": torch.load(
        stopped.checkpoint_path, map_location="cpu", weights_only=True)["step"],
        "resumed_steps": finished.steps, "resumed_stopped": finished.stopped,
        "same_weights": torch.equal(_weights(reference.model), _weights(resumed.model))}


def stop_plain(rank: int, world: int, out: Path) -> dict:
    return _stop(rank, "plain", out)


def stop_ddp(rank: int, world: int, out: Path) -> dict:
    return _stop(rank, "ddp", out)


def stop_fsdp(rank: int, world: int, out: Path) -> dict:
    return _stop(rank, "fsdp", out)


SCENARIOS = {"stop_plain": stop_plain, "stop_ddp": stop_ddp, "stop_fsdp": stop_fsdp}


if __name__ == "__main__":
    main(SCENARIOS)
