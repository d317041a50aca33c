"""One rank of ``test_runner_undo.test_two_ddp_ranks_replay_the_same_dropout_masks``.

Trains a DDP model with dropout (seeded per rank) twice on 2 gloo ranks: uninjected, then with
an OOM on rank 1 in step 1's backward; writes ``rank<r>.json`` with the OOM recoveries of the
second run and the largest difference between the two runs' weights.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import autobatch  # noqa: E402


def train(rank: int, fault: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 1)).double()
    model = nn.parallel.DistributedDataParallel(model)
    torch.manual_seed(100 + rank)  # each rank draws its own masks
    generator = torch.Generator().manual_seed(7 + rank)
    x, y = torch.randn(48, 6, generator=generator, dtype=torch.float64), torch.randn(48, 1, generator=generator, dtype=torch.float64)
    batches = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 48, 8)]
    faults = autobatch.FaultInjector((1, "backward")) if fault and rank == 1 else None
    runner = autobatch.Runner(model, torch.optim.Adam(model.parameters(), lr=1e-2),
                              lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), global_batch=16, micro_batch=4,
                              grow_after=None, progress=False, faults=faults)
    result = runner.fit(batches, epochs=2)
    return [p.detach().clone() for p in model.parameters()], len(result.oom_recoveries)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    reference, _ = train(rank, fault=False)
    replayed, recoveries = train(rank, fault=True)
    diff = max((a - b).abs().max().item() for a, b in zip(reference, replayed))
    Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps({"recoveries": recoveries, "max_diff": diff}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
