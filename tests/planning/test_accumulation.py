"""Gradient accumulation: the accumulated gradient equals the full-batch gradient.

Tolerance: the model runs in float64, so the only difference between the two gradients is
floating-point summation order; they must agree to ``atol=1e-10, rtol=1e-10``.
"""

from __future__ import annotations

from collections import namedtuple
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from autobatch.planning.accumulation import (
    accumulate_gradients,
    accumulate_micro_batches,
    accumulated_step,
    batch_size_of,
    micro_batch_sizes,
    split_batch,
)
from autobatch.probe.train_step import TrainStep

ATOL = RTOL = 1e-10
Pair = namedtuple("Pair", "x y")


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def tuple_loss(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def dict_loss(model, batch):
    return nn.functional.cross_entropy(model(batch["x"]), batch["label"]) * batch["scale"]


def grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def full_batch_grads(model, loss_fn, batch) -> tuple[list[torch.Tensor], float]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    out = grads(model)
    model.zero_grad(set_to_none=True)
    return out, loss.item()


def assert_same(a, b):
    for left, right in zip(a, b, strict=True):
        torch.testing.assert_close(left, right, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("global_batch,micro", [(12, 4), (12, 12), (10, 4), (13, 5), (7, 1), (5, 8)])
@pytest.mark.parametrize("balanced", [False, True])
def test_tuple_batch_gradients_equal_full_batch(global_batch, micro, balanced):
    model = make_model()
    torch.manual_seed(1)
    batch = (torch.randn(global_batch, 6, dtype=torch.float64), torch.randn(global_batch, 3, dtype=torch.float64))
    expected, expected_loss = full_batch_grads(model, tuple_loss, batch)
    loss = accumulate_gradients(model, tuple_loss, batch, micro, balanced=balanced)
    assert_same(grads(model), expected)
    assert loss == pytest.approx(expected_loss, rel=1e-12)


@pytest.mark.parametrize("micro", [3, 4, 9])
def test_dict_batch_with_shared_scalar_leaf(micro):
    model = make_model()
    torch.manual_seed(2)
    batch = {
        "x": torch.randn(9, 6, dtype=torch.float64),
        "label": torch.randint(0, 3, (9,)),
        "scale": torch.tensor(0.5, dtype=torch.float64),  # 0-dim: shared by every micro-batch
    }
    expected, _ = full_batch_grads(model, dict_loss, batch)
    accumulate_gradients(model, dict_loss, batch, micro)
    assert_same(grads(model), expected)


def test_split_policies_and_structures():
    assert micro_batch_sizes(10, 4) == [4, 4, 2]
    assert micro_batch_sizes(10, 4, balanced=True) == [4, 3, 3]
    assert micro_batch_sizes(8, 4) == micro_batch_sizes(8, 4, balanced=True) == [4, 4]
    assert micro_batch_sizes(3, 8) == [3]
    for g in range(1, 40):
        for m in range(1, 12):
            tail, bal = micro_batch_sizes(g, m), micro_batch_sizes(g, m, balanced=True)
            assert sum(tail) == sum(bal) == g and len(tail) == len(bal)
            assert max(bal) - min(bal) <= 1 and max(bal) <= m
    batch = Pair(torch.arange(10), [torch.arange(10) * 2, "meta"])
    parts = split_batch(batch, 4)
    assert [batch_size_of(p) for p in parts] == [4, 4, 2]
    assert isinstance(parts[0], Pair) and parts[0].y[1] == "meta"
    assert torch.equal(torch.cat([p.x for p in parts]), batch.x)
    assert parts[0].x.untyped_storage().data_ptr() == batch.x.untyped_storage().data_ptr()  # views
    with pytest.raises(ValueError, match="disagree"):
        batch_size_of((torch.zeros(3), torch.zeros(4)))
    with pytest.raises(ValueError, match="positive"):
        micro_batch_sizes(10, 0)


def test_global_batch_weighting_for_a_shard_and_no_sync():
    """A rank's shard weighted by the whole global batch; no_sync wraps all but the last."""
    model = make_model()
    torch.manual_seed(3)
    batch = (torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64))
    expected, _ = full_batch_grads(model, tuple_loss, batch)
    entered = []

    @contextmanager
    def no_sync():
        entered.append(True)
        yield

    accumulate_gradients(model, tuple_loss, (batch[0][:5], batch[1][:5]), 2, global_batch=8, no_sync=no_sync)
    accumulate_gradients(model, tuple_loss, (batch[0][5:], batch[1][5:]), 2, global_batch=8)
    assert_same(grads(model), expected)
    assert len(entered) == 2  # 3 micro-batches (2, 2, 1): the last one syncs


def test_lazy_micro_batches_and_accumulated_step_matches_full_step():
    torch.manual_seed(4)
    data = (torch.randn(11, 6, dtype=torch.float64), torch.randn(11, 3, dtype=torch.float64))
    reference = make_model()
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt_ref.zero_grad()
    tuple_loss(reference, data).backward()
    opt_ref.step()

    model = make_model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), tuple_loss, make_batch=None)
    micro = (m for m in split_batch(data, 3, balanced=True))  # a generator
    accumulated_step(step, micro, global_batch=11)
    assert_same(list(model.parameters()), list(reference.parameters()))
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="no micro-batches"):
        accumulate_micro_batches(model, tuple_loss, [], global_batch=1)


@pytest.mark.parametrize("form", ["accumulate", "runner_step", "trial"])
def test_a_micro_batchs_inputs_are_freed_before_its_backward(form):
    """Backward needs what autograd saved, not the inputs: every step form lets them go after
    forward, as a hand loop that writes ``loss_fn(model, make())`` does (an fp32 image batch
    under autocast is otherwise held beside its saved bf16 copy through the peak)."""
    import weakref

    from autobatch.planning.accumulation import LazyMicroBatches

    model = nn.Linear(4, 1)
    alive_in_backward: list[bool] = []

    def loss_fn(m, batch):
        ref = weakref.ref(batch)
        out = m(batch.double().float())  # the cast copy is what autograd saves
        out.register_hook(lambda grad: alive_in_backward.append(ref() is not None))
        return out.square().mean()

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    moved = lambda piece: piece.clone()  # noqa: E731 - the runner's transfer: a copy per micro-batch
    pieces = list(torch.randn(6, 4).split(2))
    if form == "accumulate":
        accumulate_micro_batches(model, loss_fn, LazyMicroBatches(pieces, moved), global_batch=6)
    elif form == "runner_step":  # what Runner calls for each global batch
        accumulated_step(TrainStep(model, optimizer, loss_fn, None), LazyMicroBatches(pieces, moved), global_batch=6, lazy=True)
    else:
        TrainStep(model, optimizer, loss_fn, lambda b: torch.randn(b, 4))(3)
    assert alive_in_backward and not any(alive_in_backward)


def test_per_sample_lists_of_plain_values_are_split_with_the_tensors():
    """A default-collated list of file names has one entry per sample: each micro-batch gets its
    own entries (every micro-batch got the whole list). A tuple of numbers is a constant, whatever
    its length (default_collate makes per-sample numbers a tensor): it was split when it happened
    to be as long as the batch (tests/planning/test_batch_forms.py)."""
    from autobatch.planning.accumulation import split_batch

    batch = {"x": torch.zeros(5, 3), "name": ["a", "b", "c", "d", "e"], "ids": (1, 2, 3, 4, 5), "shape": [224, 224]}
    parts = split_batch(batch, 2)
    assert [p["name"] for p in parts] == [["a", "b"], ["c", "d"], ["e"]]
    assert all(p["ids"] == (1, 2, 3, 4, 5) for p in parts)  # a tuple of numbers: shared
    assert all(p["shape"] == [224, 224] for p in parts)  # not one value per sample: shared


def test_global_batch_is_checked_before_it_weights_the_losses():
    """0 divided by zero; a negative global batch flipped the gradient (the optimizer climbed
    the loss); one smaller than the samples given scaled the gradient up, all without a word."""
    model = make_model()
    batch = (torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64))
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), tuple_loss, None)
    before = [p.detach().clone() for p in model.parameters()]
    for bad in (0, -8, 2.5, True, "8"):
        with pytest.raises(ValueError, match=r"global_batch must be a positive integer .*got"):
            accumulate_gradients(model, tuple_loss, batch, 4, global_batch=bad)
        with pytest.raises(ValueError, match=r"global_batch must be a positive integer"):
            accumulated_step(step, split_batch(batch, 4), global_batch=bad)
    with pytest.raises(ValueError, match=r"global_batch=4 is smaller than the 8 samples given"):
        accumulate_gradients(model, tuple_loss, batch, 4, global_batch=4)
    assert all(p.grad is None for p in model.parameters())  # refused before any backward
    with pytest.raises(ValueError, match=r"global_batch=6 is smaller than the samples given \(at least 8"):
        accumulated_step(step, split_batch(batch, 4), global_batch=6)
    with pytest.raises(ValueError, match=r"global_batch must be a positive integer"):
        accumulate_micro_batches(model, tuple_loss, split_batch(batch, 4), global_batch=-8.0)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # no step was taken
    accumulate_micro_batches(model, tuple_loss, split_batch(batch, 4), global_batch=16.0)  # a float only weights


def test_cycled_samples_are_the_indexed_ones_and_build_under_fake_tensors():
    """The runner plans on its first batch: make_batch(n) took samples i % available with
    index.tolist(), which fake tensors cannot do, so strategy="estimate" always failed and auto
    lost its estimated first trial."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autobatch.planning.samples import cycle_samples, take_samples

    batch = {"x": torch.arange(10.0).view(5, 2), "names": [f"s{i}" for i in range(5)], "scale": torch.tensor(2.0)}
    for size in (1, 3, 5, 7, 12):
        cycled = cycle_samples(batch, size, 5)
        indexed = take_samples(batch, torch.arange(size) % 5, 5)
        assert torch.equal(cycled["x"], indexed["x"]) and cycled["names"] == indexed["names"]
        assert cycled["scale"] is batch["scale"] and cycled["x"].data_ptr() != batch["x"].data_ptr()  # a copy
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = cycle_samples(batch, 12, 5)
        assert fake["x"].shape == (12, 2) and fake["names"] == indexed["names"]
        assert take_samples({"x": batch["x"]}, torch.arange(7) % 5, 5)["x"].shape == (7, 2)  # tensors only: no tolist
    with pytest.raises(ValueError, match="size must be a positive integer"):
        cycle_samples(batch, 0, 5)


def test_a_runner_plans_its_micro_batch_with_the_estimate_strategy():
    import autobatch

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))
    data = [(torch.randn(64, 32), torch.randint(0, 10, (64,))) for _ in range(2)]
    runner = autobatch.Runner(model, torch.optim.AdamW(model.parameters()),
                              lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), global_batch=64, progress=False,
                              grow_after=None, plan_options={"memory_limit": "1MiB", "cache": False, "strategy": "estimate"})
    with autobatch.simulated_memory("1MiB"):
        result = runner.fit(data, steps=2)
    assert result.micro_batch == 64 and result.plan["probes"][0]["result"]["strategy_used"] == "estimate"


def test_review35_accumulate_gradients_names_a_wrong_model_or_loss_fn_before_any_forward():
    """accumulate_gradients builds no TrainStep, so it made none of its checks: (loss_fn, model) swapped
    failed as "Sequential.forward() takes 2 positional arguments but 3 were given", nn.CrossEntropyLoss()
    or F.cross_entropy as "argument 'input' must be Tensor, not Sequential", a loss_fn(batch) as "takes 1
    positional argument but 2 were given", all from inside the first micro-batch."""
    model = make_model()
    batch = (torch.randn(6, 6, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64))
    cases = [((tuple_loss, model), r"takes the model first.*look swapped"),
             ((model, nn.MSELoss()), r"MSELoss\(\) is a criterion.*wrap it"),
             ((model, nn.functional.mse_loss), r"torch's own function.*wrap it"),
             ((model, lambda batch: batch), r"cannot be called so: give it the arguments \(model, batch\)")]
    for (first, second), message in cases:
        with pytest.raises(TypeError, match=message):
            accumulate_gradients(first, second, batch, 2)
    assert all(p.grad is None for p in model.parameters())


def test_review35_split_batch_refuses_a_string_for_balanced():
    """balanced="no" is truthy: split_batch and accumulate_gradients cut 10 by 4 into 4, 3, 3 without a word."""
    batch = torch.randn(10, 2)
    with pytest.raises(TypeError, match=r"balanced must be True or False, got str 'no'; pass balanced=False"):
        split_batch(batch, 4, balanced="no")
    with pytest.raises(TypeError, match=r"balanced must be True or False"):
        accumulate_gradients(make_model(), tuple_loss, (torch.randn(10, 6).double(), torch.randn(10, 3).double()), 4,
                             balanced="no")
    assert [len(piece) for piece in split_batch(batch, 4, balanced=False)] == [4, 4, 2]


def test_review36_accumulate_gradients_takes_an_autocast_dtype_or_object_and_names_a_bad_one():
    """``autocast=torch.float16`` (as ``TrainStep(autocast_dtype=)`` takes it) failed as "'torch.dtype' object is
    not callable", ``"float16"`` as "'str' object is not callable" and ``torch.autocast("cpu", ...)`` as
    "missing 1 required positional argument: 'func'", from the first micro-batch: each now runs the micro-batches
    under fp16 autocast, as the factory does; a value of another kind, or a bad scaler, is one error naming it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    batch = (torch.randn(12, 4), torch.randn(12, 1))
    seen = []

    def loss_fn(m, b):
        out = m(b[0])
        seen.append(out.dtype)
        return nn.functional.mse_loss(out.float(), b[1])

    losses = []
    for autocast in (lambda: torch.autocast("cpu", dtype=torch.float16), torch.float16, "float16",
                     torch.autocast("cpu", dtype=torch.float16)):
        losses.append(accumulate_gradients(model, loss_fn, batch, 4, autocast=autocast))
    assert seen == [torch.float16] * 12 and losses[1:] == losses[:1] * 3
    with pytest.raises(TypeError, match="autocast must be a dtype"):
        accumulate_gradients(model, loss_fn, batch, 4, autocast=True)
    with pytest.raises(ValueError, match="autocast='int8' is not one of bfloat16, float16"):
        accumulate_gradients(model, loss_fn, batch, 4, autocast="int8")
    with pytest.raises(TypeError, match="grad_scaler must be a torch.amp.GradScaler"):
        accumulate_gradients(model, loss_fn, batch, 4, grad_scaler=True)


def test_review37_sparse_plan_probe_runs_every_micro_batch():
    """The planner's accumulated probe of a sparse-gradient step runs the plan's whole step: torch adds sparse
    gradients uncoalesced, so they grow by every micro-batch (a SparseAdam embedding planned 118 x 17 under 8 MiB
    from two micro-batches ran out of memory in its first step); a dense step's two micro-batches stay."""
    from autobatch.planning.sparse_accumulation import accumulating_step
    from autobatch.probe.train_step import TrainStep

    sizes = []
    def loss_fn(model, batch):
        sizes.append(batch[0].shape[0])
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
    make_batch = lambda n: (torch.randint(0, 50, (n, 3)), torch.randint(0, 2, (n,)))
    for sparse, expected in ((True, [4, 4, 2]), (False, [4, 4])):
        model = nn.Sequential(nn.Embedding(50, 4, sparse=sparse), nn.Flatten(), nn.Linear(12, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        sizes.clear()
        accumulating_step(TrainStep(model, optimizer, loss_fn, make_batch), 10)(4)
        assert sizes == expected
        assert model[0].weight.grad is None  # one optimizer step, gradients zeroed after it
