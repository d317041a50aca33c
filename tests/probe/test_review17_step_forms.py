"""Step forms a user brings next: a ``make_batch`` drawing from seeded generators of its own, a step
that keeps its outputs from call to call, and ``loss_fn``/``make_batch`` passed in the wrong order."""

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from autobatch import TrainStep, estimate_memory, find_max_batch
from autobatch.memory.units import format_bytes


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def test_own_generators_are_put_back_by_the_estimate_the_probe_and_a_cache_hit(tmp_path):
    """Seeded generators the batch maker closes over (torch's, NumPy's, Python's) were left
    advanced: a seeded run's data after a probe differed from the same run's after a cache hit."""
    data, numbers, draws = torch.Generator().manual_seed(0), np.random.default_rng(0), random.Random(0)

    def make_batch(n):
        noise = float(numbers.standard_normal()) + draws.random()
        return torch.randn(n, 16, generator=data) + noise * 0, torch.randint(0, 4, (n,), generator=data)

    model = _model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     lambda m, b: F.cross_entropy(m(b[0]), b[1]), make_batch)

    def states():
        return data.get_state(), numbers.bit_generator.state, draws.getstate()

    before = states()
    estimate_memory(step, 8)
    find_max_batch(step, memory_limit="64KiB", max_batch=32, cache=tmp_path)
    assert find_max_batch(step, memory_limit="64KiB", max_batch=32, cache=tmp_path).cached
    after = states()
    assert torch.equal(after[0], before[0]) and after[1:] == before[1:]


@pytest.mark.parametrize("keeps", [True, False])
def test_a_step_keeping_its_outputs_is_told_how_soon_it_runs_out(keeps):
    """Its answer passed three steps at the boundary and trained four more: nothing was said."""
    kept = []

    def loss(m, batch):
        out = m(batch[0])
        if keeps:
            kept.append(out.detach())
        return F.cross_entropy(out, batch[1])

    model = _model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), loss,
                     lambda n: (torch.randn(n, 16), torch.randint(0, 4, (n,))))
    result = find_max_batch(step, strategy="binary", memory_limit="256KiB", cache=False)
    notes = [n for n in result.notes if n.startswith("memory held between steps grew")]
    if not keeps:
        assert notes == []
        return
    assert len(notes) == 1 and f"batch {result.batch_size}'s trial" in notes[0]
    grew = format_bytes(result.batch_size * 4 * 4)  # its logits: 4 float32 per sample
    assert f"grew by {grew} in each" in notes[0] and "runs out of memory after about" in notes[0]


def test_loss_fn_and_make_batch_in_the_wrong_order_are_named_when_the_step_is_built():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = lambda m, b: F.cross_entropy(m(b[0]), b[1])  # noqa: E731
    make_batch = lambda n: (torch.randn(n, 16), torch.randint(0, 4, (n,)))  # noqa: E731
    with pytest.raises(TypeError, match="look swapped"):
        TrainStep(model, optimizer, make_batch, loss_fn)
    with pytest.raises(TypeError, match=r"loss_fn is called as loss_fn\(model, batch\).*\(batch\)"):
        TrainStep(model, optimizer, lambda batch: batch, make_batch)


def test_a_disabled_grad_scaler_in_restore_is_put_back():
    """``GradScaler(enabled=use_fp16)`` off, in ``restore``: its restore raised AttributeError
    ('_per_optimizer_states') after every probe."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)

    def step(n):
        optimizer.zero_grad()
        scaler.scale(F.cross_entropy(model(torch.randn(n, 16)), torch.randint(0, 4, (n,)))).backward()
        scaler.step(optimizer)
        scaler.update()

    before = [p.detach().clone() for p in model.parameters()]
    result = find_max_batch(step, strategy="binary", max_batch=8, memory_limit="64KiB", restore=(model, optimizer, scaler))
    assert result.batch_size == 8
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_fp16_trials_whose_scaled_gradients_overflow_still_make_the_optimizer_state():
    """From a high ``init_scale`` every trial's ``scaler.step`` skipped AdamW's step, so no trial
    measured its moments, and training at the answer ran out of memory once a step was taken."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**60)
    step = TrainStep(model, optimizer, lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                     lambda n: (torch.randn(n, 16), torch.randint(0, 4, (n,))), autocast_dtype="float16", grad_scaler=scaler)
    result = find_max_batch(step, strategy="binary", max_batch=4, memory_limit="256KiB", cache=False)
    moments = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    assert result.trials[0].resident_bytes >= moments  # its last step ran beside AdamW's moments
    assert scaler.state_dict()["scale"] == 2.0**60 and not optimizer.state  # both put back
