"""A single-GPU script moved to ``torch.distributed`` (one process, no launch: a one-rank gloo
group on a ``HashStore``, ``Runner(distributed=True)`` taking the path a job of several ranks takes).

``FullyShardedDataParallel`` (FSDP1, the older wrapper that many scripts still use) has a
``.module`` and a ``no_sync`` like DDP, so the runner and the probe took it for a DDP-like
wrapper and trained its inner module, whose parameters are views of FSDP1's flat parameter:
``fit()`` failed at its first step with autograd's "Output 0 of View is a view and its base ...
has been modified inplace", naming nothing to change, and the probe's trials ran the same inner
module. Now ``Runner(...)`` and the probe refuse it at once with one error naming
``fully_shard`` (FSDP2) and DDP, which autobatch drives.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autobatch
from autobatch.dist.fsdp import FsdpProbeAgreement
from one_rank import one_rank_group, one_rank_mesh  # noqa: F401 - the fixtures

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")

FSDP1_FIX = r"FullyShardedDataParallel \(FSDP1\).*fully_shard.*DistributedDataParallel"


def _loss(model, batch):
    return model(batch).pow(2).mean()


def test_an_fsdp1_model_is_one_clear_error_at_the_runner_and_the_probe(one_rank_group):
    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    model = FullyShardedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)),
                                     device_id=torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=FSDP1_FIX):  # before: built, then fit() failed in autograd
        autobatch.Runner(model, optimizer, _loss, global_batch=8, micro_batch=4, progress=False, distributed=True)
    step = autobatch.TrainStep(model, optimizer, _loss, lambda n: torch.randn(n, 8))
    with pytest.raises(ValueError, match=FSDP1_FIX):  # before: the trials ran FSDP1's inner module
        FsdpProbeAgreement().local_step(step)  # the probe's path under torchrun
    inner = nn.Sequential(nn.Linear(8, 4))
    nested = nn.Sequential(FullyShardedDataParallel(inner, device_id=torch.device("cpu")), nn.Linear(4, 1))
    with pytest.raises(ValueError, match=FSDP1_FIX):  # FSDP1 inside a plain root: its forward gathers too
        autobatch.Runner(nested, torch.optim.SGD(nested.parameters(), lr=0.1), _loss, global_batch=8, micro_batch=4,
                         progress=False, distributed=True)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 16))


def _fit(model: nn.Module, memory: str, batches: list[torch.Tensor]) -> autobatch.RunResult:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with autobatch.simulated_memory(memory):
        runner = autobatch.Runner(model, optimizer, _loss, global_batch=512, micro_batch=512, progress=False,
                                  log_every=None, grow_after=None)
        return runner.fit(batches)


def test_a_one_rank_fully_shard_model_replays_an_oom_in_backward_to_the_right_weights(one_rank_mesh):
    """``fully_shard`` in a group of one rank (``torchrun --nproc-per-node 1``, an FSDP2 script on one
    GPU) trains in one process. An OOM part-way through backward left FSDP2 mid-step: the unsharded
    gradients of the layers whose reduce-scatter had not run yet stayed on their unsharded parameters,
    and the replay's backward added onto them, so the step applied part of the failed attempt's
    gradient again (weights off by 3.5e-3 after 2 steps, without a word). Now the one-process reset
    after a failed step resets FSDP2 too, as the voted step does across ranks."""
    from torch.distributed.fsdp import fully_shard

    batches = [torch.randn(512, 16) for _ in range(2)]
    reference = _mlp()
    _fit(reference, "1GiB", batches)
    model = _mlp()
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=one_rank_mesh)
    fully_shard(model, mesh=one_rank_mesh)
    result = _fit(model, "1900KiB", batches)  # one OOM in backward (2200KiB before resize_ counted)
    assert [r["phase"] for r in result.oom_recoveries] == ["backward"] and result.steps == 2
    for got, want in zip(model.parameters(), reference.parameters()):  # sharded again: before, some were left unsharded
        torch.testing.assert_close(got.full_tensor(), want, rtol=1e-5, atol=1e-6)  # before: off by 3.5e-3



class _BackwardOOM(torch.autograd.Function):
    """Saves its input for a backward that runs out of memory (a rank whose backward met the wall)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sum()

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected in backward)")


def test_review39_a_ddp_probe_step_that_ran_out_in_backward_frees_its_graph_before_completing_the_buckets(one_rank_group):
    """Review 39: ``DDPProbeStep`` kept the failed step's loss (its graph: 2 MiB of activations here)
    alive while it allocated the zeros (2 MiB) that complete DDP's buckets; on a rank at its wall that
    ran out too ("could not complete DDP's gradient buckets", not an OOM), and its peers waited in the
    buckets until the sync deadline (2 gloo ranks, ``find_max_batch`` of a DDP GPT under 8 and 4 MiB)."""
    from autobatch import simulated_memory
    from autobatch.dist.ddp_probe import DDPProbeStep

    torch.manual_seed(0)
    model = nn.Linear(512, 512).double()
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = DDPProbeStep(autobatch.TrainStep(ddp, optimizer, lambda module, batch: _BackwardOOM.apply(module(batch).repeat(1, 8)),
                                            lambda n: torch.randn(n, 512, dtype=torch.float64)))
    with simulated_memory("3MiB"), pytest.raises(torch.OutOfMemoryError, match="injected in backward"):
        step(64)
