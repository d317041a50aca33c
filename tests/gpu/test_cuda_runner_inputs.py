"""Real-GPU checks of the runner's first-step and replay guards (skipped without CUDA; run with
``bash scripts/gpu_tests.sh``): a cuDNN LSTM fed sequence-first batches is named at the first
step (its forward pre-hook sees the cuDNN module's input), a buffer that forward replaces is put
back on the GPU before an OOM replay, and the probe notes adapters a reentrant checkpoint cut off."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import autobatch
from autobatch import FaultInjector, Runner, find_max_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class Recurrent(nn.Module):
    """A cuDNN LSTM (batch_first=False, the default) and a head."""

    def __init__(self, transpose: bool) -> None:
        super().__init__()
        self.transpose = transpose
        self.lstm = nn.LSTM(16, 32)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x.transpose(0, 1) if self.transpose else x)
        return self.head(out[-1])


@pytest.mark.parametrize("transpose", [False, True])
def test_a_cudnn_lstm_fed_sequence_first_batches_is_named_once(transpose, caplog):
    torch.manual_seed(0)
    model = Recurrent(transpose).cuda()
    batches = [torch.randn(8, 24, 16, device="cuda") for _ in range(3)]  # read as [B=8, T=24] by the runner
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).pow(2).mean(),
                    global_batch=8, micro_batch=4, progress=False)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        runner.fit(batches)
    warned = [r.getMessage() for r in caplog.records if "batch_first=False" in r.getMessage()]
    # fed [4, 24, 16] micro-batches, the LSTM reads 4 time steps of 24 samples: named unless the model transposes
    assert len(warned) == (0 if transpose else 1), warned
    assert not model.lstm._forward_pre_hooks and runner.result.steps == 3


class InputAverage(nn.Module):
    """Keeps an EMA of its inputs and a count of forward calls, both replaced by forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 1)
        self.register_buffer("mean", torch.zeros(64))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mean = 0.9 * self.mean + 0.1 * x.detach().mean(0)
        self.calls = self.calls + 1
        return self.linear(x)


def _averaged(fault: tuple[int, str] | None) -> InputAverage:
    torch.manual_seed(0)
    model = InputAverage().cuda()
    data = [(torch.randn(16, 64, device="cuda"),) for _ in range(3)]
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b[0]).pow(2).mean(),
                    global_batch=16, micro_batch=8, grow_after=None, progress=False,
                    faults=FaultInjector([fault], times=1) if fault else None)
    runner.fit(data)
    assert len(runner.result.oom_recoveries) == (1 if fault else 0)
    return model


def test_a_buffer_forward_replaces_is_put_back_on_the_gpu_before_a_replay():
    # an optimizer-step OOM replays at the same micro-batch (optimizer_phase): against no OOM
    reference, replayed = _averaged(None), _averaged((1, "optimizer"))
    assert int(replayed.calls) == int(reference.calls) and replayed.mean.is_cuda
    torch.testing.assert_close(replayed.mean, reference.mean)


class Adapted(nn.Module):
    """A frozen embedding and blocks with trainable low-rank adapters, checkpointed reentrantly by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(128, 64).requires_grad_(False)
        self.blocks = nn.ModuleList(nn.Linear(64, 64).requires_grad_(False) for _ in range(2))
        self.down = nn.ModuleList(nn.Linear(64, 4, bias=False) for _ in range(2))
        self.up = nn.ModuleList(nn.Linear(4, 64, bias=False) for _ in range(2))
        self.head = nn.Linear(64, 128)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block, down, up in zip(self.blocks, self.down, self.up):
            x = checkpoint(lambda h, b=block, d=down, u=up: torch.relu(b(h) + u(d(h))), x, use_reentrant=True)
        return self.head(x)


def test_adapters_a_reentrant_checkpoint_cuts_off_are_noted_on_the_gpu():
    torch.manual_seed(0)
    model = Adapted().cuda()
    trained = [p for p in model.parameters() if p.requires_grad]
    step = autobatch.TrainStep(model, torch.optim.AdamW(trained, lr=1e-3),
                               lambda m, b: nn.functional.cross_entropy(m(b).flatten(0, 1), b.flatten()),
                               lambda n: torch.randint(0, 128, (n, 32), device="cuda"))
    result = find_max_batch(step, memory_limit="256MiB", max_batch=64, cache=False)
    assert result.batch_size == 64
    assert any("4 of the 6 parameters the optimizer trains got no gradient" in note for note in result.notes), result.notes


class _Recommender(nn.Module):
    """A ``sparse=True`` embedding table (float64) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.items = nn.EmbeddingBag(4000, 16, sparse=True, mode="mean", dtype=torch.float64)
        self.head = nn.Linear(16, 1, dtype=torch.float64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.items(ids)).squeeze(-1)


@pytest.mark.parametrize("guard", ["auto", "device"])
def test_sparse_momentum_and_clipping_replay_on_the_gpu(guard):
    """SGD's momentum of a sparse embedding is a sparse CUDA tensor the step guard copies (it
    crashed every such run at step 2), and ``max_grad_norm`` clips its sparse gradient: through
    two replays the weights are the unsplit loop's (``scripts/diag_sparse_runner.py``)."""
    from autobatch.probe.train_step import clip_grad_norm

    def loss_fn(model, batch):
        return nn.functional.mse_loss(model(batch[0]), batch[1])

    def made():
        torch.manual_seed(0)
        model = _Recommender().cuda()
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    generator = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 4000, (64, 3), generator=generator).cuda(),
             torch.randn(64, dtype=torch.float64, generator=generator).cuda()) for _ in range(4)]
    reference, optimizer = made()
    for batch in data:
        optimizer.zero_grad()
        loss_fn(reference, batch).backward()
        clip_grad_norm(list(reference.parameters()), 0.05)
        optimizer.step()
    model, optimizer = made()
    runner = Runner(model, optimizer, loss_fn, global_batch=64, micro_batch=32, progress=False, grow_after=None,
                    step_guard=guard, max_grad_norm=0.05, faults=FaultInjector([(1, "optimizer"), (2, "backward")], times=1))
    result = runner.fit(data, epochs=1)
    assert result.steps == 4 and len(result.oom_recoveries) == 2
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=1e-12)
