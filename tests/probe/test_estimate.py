"""Zero-OOM estimates: fake-tensor traces against simulated_memory's measured peaks (CPU)."""

import queue

import pytest
import torch

import autobatch
from autobatch import find_max_batch, simulated_memory
from autobatch.planning.checkpointing import enable_checkpointing
from autobatch.probe.tracing.estimate import EstimateError, estimate_max_batch, estimate_memory, estimate_peak

from workloads import make_mlp_step

#: Stated accuracy on the CPU: the estimate and simulated_memory count allocations the same
#: way, so they agree to a few hundred bytes (measured: < 0.02 %); 2 % leaves room for kernels.
TOLERANCE = 0.02


def make_cnn_step(autocast_dtype=None) -> autobatch.TrainStep:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return autobatch.TrainStep(
        model, opt, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
        lambda size: (torch.randn(size, 3, 16, 16), torch.randint(0, 10, (size,))),
        autocast_dtype=autocast_dtype,
    )


class TinyTransformer(torch.nn.Module):
    def __init__(self, vocab: int = 100, width: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.1, batch_first=True) for _ in range(layers)
        )
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens):
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


def make_transformer_step(autocast_dtype=None, checkpointing=False) -> autobatch.TrainStep:
    torch.manual_seed(0)
    model = TinyTransformer()
    if checkpointing:
        enable_checkpointing(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_fn(model, batch):
        return torch.nn.functional.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten())

    return autobatch.TrainStep(
        model, opt, loss_fn, lambda size: (torch.randint(0, 100, (size, 16)), torch.randint(0, 100, (size, 16))),
        autocast_dtype=autocast_dtype,
    )


WORKLOADS = {
    "mlp-adam": lambda: make_mlp_step(width=128),
    "mlp-sgd": lambda: make_mlp_step(width=128, optimizer="sgd"),
    "cnn": make_cnn_step,
    "cnn-bf16": lambda: make_cnn_step(torch.bfloat16),
    "transformer": make_transformer_step,
    "transformer-bf16-checkpointed": lambda: make_transformer_step(torch.bfloat16, checkpointing=True),
}


def measured_peak(step, batch_size: int, steps: int = 2) -> int:
    with simulated_memory("4GiB") as device:
        for _ in range(steps):
            step(batch_size)
        return device.peak_bytes


@pytest.mark.parametrize("name", sorted(WORKLOADS))
@pytest.mark.parametrize("batch_size", [3, 24])
def test_estimate_matches_the_simulated_peak(name, batch_size):
    step = WORKLOADS[name]()
    estimate = estimate_memory(step, batch_size)
    measured = measured_peak(step, batch_size)
    assert estimate.step_peak_bytes == pytest.approx(measured, rel=TOLERANCE)
    params = sum(p.numel() * p.element_size() for p in step.model.parameters())
    assert estimate.resident_bytes >= params


def test_checkpointing_lowers_the_estimate():
    plain = estimate_peak(make_transformer_step(), 32)
    checkpointed = estimate_peak(make_transformer_step(checkpointing=True), 32)
    assert checkpointed < plain


def test_estimating_leaves_model_and_optimizer_untouched():
    step = make_transformer_step()
    before = {name: p.detach().clone() for name, p in step.model.state_dict().items()}
    params = list(step.model.parameters())
    estimate_memory(step, 8)
    assert list(step.model.parameters()) == params  # same objects, back in place
    assert all(type(p) is torch.nn.Parameter and p.grad is None for p in params)
    assert not step.optimizer.state
    after = step.model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert step.optimizer.param_groups[0]["params"][0] is params[0]


def test_existing_optimizer_state_is_resident_and_not_created_again():
    step = make_mlp_step(width=128)
    fresh = estimate_memory(step, 16)
    step(2)  # creates Adam's moments for real
    warm = estimate_memory(step, 16)
    moments = 2 * sum(p.numel() * 4 for p in step.model.parameters())
    assert warm.resident_bytes - fresh.resident_bytes >= moments
    assert warm.peak_bytes == pytest.approx(fresh.peak_bytes, rel=0.01)


def test_grad_scaler_and_lr_scheduler_are_not_disturbed():
    step = make_mlp_step(width=64)
    scheduler = torch.optim.lr_scheduler.StepLR(step.optimizer, step_size=1)
    scaler = torch.amp.GradScaler("cpu")
    step.grad_scaler = scaler
    estimate_memory(step, 8)
    assert scaler._scale is None and not scaler._per_optimizer_states
    assert not step.optimizer.state and scheduler.last_epoch == 0


def test_an_fp16_step_with_gradient_clipping_is_estimated():
    """The standard fp16 recipe unscales the gradients before clipping them: the trace's scaler
    does that in place too (it had no unscale_, and the estimate failed)."""
    step = make_mlp_step(width=64)
    step.grad_scaler, step.max_grad_norm = torch.amp.GradScaler("cpu"), 1.0
    with simulated_memory("8MiB"):
        estimated = find_max_batch(step, strategy="estimate", cache=False).batch_size
        probed = find_max_batch(step, strategy="binary", cache=False).batch_size
    assert abs(estimated - probed) <= 0.05 * probed


def test_a_model_that_cannot_train_at_batch_one_is_estimated_from_two():
    """BatchNorm in training needs more than one value per channel: the estimate's smallest size
    is then 2 (it traced 1 and failed), and it lands near the probed answer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.BatchNorm1d(256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    step = autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               lambda m, b: m(b).square().mean(), lambda n: torch.randn(n, 32))
    with simulated_memory("4MiB"):
        estimated = find_max_batch(step, strategy="estimate", cache=False).batch_size
        probed = find_max_batch(step, strategy="binary", start=2, cache=False).batch_size
    assert abs(estimated - probed) <= 0.05 * probed


def test_untraceable_step_raises_estimate_error():
    step = make_mlp_step(width=64)
    plain_loss = step.loss_fn
    step.loss_fn = lambda model, batch: plain_loss(model, batch) * (1.0 if plain_loss(model, batch).item() > 0 else 2.0)
    with pytest.raises(EstimateError, match="could not trace"):
        estimate_memory(step, 4)
    with pytest.raises(EstimateError):
        estimate_memory(lambda size: None, 4)


class _Recurrent(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.rnn = kind(16, 64, batch_first=True)
        self.head = torch.nn.Linear(64, 1)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def _recurrent_step(kind):
    torch.manual_seed(0)
    model = _Recurrent(kind)
    return autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).square().mean(),
                               lambda size: torch.randn(size, 20, 16))


def test_steps_fake_tensors_count_short_are_refused_and_auto_probes_with_trials():
    """A CPU LSTM's kernel workspace (0 in the trace: 0.6 of 3.1 MB) and sparse gradients
    (data-dependent rows) would make the estimate answer a size that runs out of memory."""
    lstm = _recurrent_step(torch.nn.LSTM)
    with pytest.raises(EstimateError, match="LSTM on the CPU"):
        estimate_memory(lstm, 8)
    auto = find_max_batch(lstm, memory_limit="32MiB", cache=False, steps_per_trial=2)
    assert any("no estimate for the first trial" in note for note in auto.notes)
    assert auto.batch_size == find_max_batch(lstm, memory_limit="32MiB", cache=False, strategy="binary",
                                             steps_per_trial=2).batch_size
    gru = _recurrent_step(torch.nn.GRU)  # within 4 %: estimated as before
    with simulated_memory("1GiB") as budget:
        gru(32)
        gru(32)
    assert abs(estimate_peak(gru, 32) / budget.peak_bytes - 1) < 0.05
    sparse = make_mlp_step(width=64)
    sparse.model[0] = torch.nn.EmbeddingBag(64, 64, sparse=True)
    with pytest.raises(EstimateError, match="sparse gradients"):
        estimate_memory(sparse, 4)


def test_estimated_max_batch_is_the_probed_boundary():
    step = make_mlp_step(width=256)
    estimate = estimate_max_batch(step, "64MiB", include_resident=False)
    probed = find_max_batch(step, memory_limit="64MiB", strategy="binary", steps_per_trial=2)
    assert estimate.batch_size == pytest.approx(probed.batch_size, rel=0.01)
    assert estimate.peak_bytes <= 64 * 2**20
    assert len(estimate.estimates) < 16


def test_a_gpu_sized_question_on_the_cpu():
    step = make_transformer_step()
    answer = estimate_max_batch(step, "8GiB", multiple_of=8)  # 8 GiB, not 80: one trace fewer (each ~0.5 s)
    assert answer.batch_size > 10_000 and answer.batch_size % 8 == 0
    assert answer.peak_bytes <= 8 * 2**30 < estimate_peak(step, answer.batch_size + 8)
    assert estimate_max_batch(step, "1KiB").batch_size == 0
    assert estimate_max_batch(step, "80GiB", max_batch=10).batch_size == 10  # capped off the x8 ladder (1, 8, 10)


# -- in find_max_batch ----------------------------------------------------------------------
def test_strategy_estimate_is_untested_and_runs_nothing():
    step = make_mlp_step(width=256)
    made = queue.SimpleQueue()  # not a list: the trace puts a list it reaches back as it was
    make = step.make_batch

    def recording(size):
        batch = make(size)
        made.put(type(batch[0]).__name__)
        return batch

    step.make_batch = recording
    result = find_max_batch(step, strategy="estimate", memory_limit="24MiB")
    assert not result.tested and result.trials == [] and result.strategy_used == "estimate"
    kinds = {made.get() for _ in range(made.qsize())}
    assert kinds == {"FakeTensor"}  # no real batch was ever built
    probed = find_max_batch(step, strategy="binary", memory_limit="24MiB", steps_per_trial=2, cache=False)
    assert result.batch_size == pytest.approx(probed.batch_size, rel=0.01)
    assert any("untested" in note for note in result.notes) and "untested" in result.summary()
    assert autobatch.ProbeResult.from_dict(result.to_dict()).tested is False
    with pytest.raises(ValueError, match="TrainStep"):
        find_max_batch(lambda size: None, strategy="estimate")


def test_auto_places_its_first_trial_by_the_estimate():
    step = make_mlp_step(width=256)
    auto = find_max_batch(step, memory_limit="24MiB", steps_per_trial=2, cache=False)
    binary = find_max_batch(step, strategy="binary", memory_limit="24MiB", steps_per_trial=2, cache=False)
    assert auto.batch_size == binary.batch_size  # still exact
    assert auto.trials[0].purpose == "estimate" and auto.estimate is not None
    assert auto.num_trials <= 4 and auto.num_ooms <= 1
    assert auto.num_trials < binary.num_trials // 3


def test_auto_without_an_estimate_probes_as_before():
    step = make_mlp_step(width=64)
    plain_loss = step.loss_fn
    step.loss_fn = lambda model, batch: plain_loss(model, batch) + 0 * plain_loss(model, batch).item()
    result = find_max_batch(step, memory_limit="16MiB", steps_per_trial=1, max_batch=512, cache=False)
    assert result.trials[0].purpose == "fit" and result.estimate is None
    assert any("no estimate" in note for note in result.notes)
    explicit_start = find_max_batch(make_mlp_step(width=64), start=4, memory_limit="16MiB", steps_per_trial=1,
                                    max_batch=512, cache=False)
    assert explicit_start.trials[0].batch_size == 4 and explicit_start.estimate is None


def _oracle(threshold: int):
    calls = []

    def passes(units, purpose="search"):
        calls.append((units, purpose))
        return units <= threshold

    return passes, calls


@pytest.mark.parametrize("true_boundary", [500, 700, 1000, 1300])
def test_predictive_with_a_prior_is_exact_whatever_the_estimate(true_boundary):
    from autobatch.probe.searching.predict import LinearFit, predictive

    passes, calls = _oracle(true_boundary)
    prior = LinearFit(intercept=0.0, slope=1000.0)  # estimated boundary: unit 1000 of capacity 1e6

    def peak_of(units):  # the real curve: boundary at true_boundary
        return int(units * 1e6 / (true_boundary + 0.5))

    outcome = predictive(passes, peak_of, 1, 2**20, 1_000_000, prior=prior)
    assert outcome.units == true_boundary
    assert calls[0] == (970, "estimate")
    if true_boundary >= 970:
        assert len(calls) <= 4
    else:
        assert "estimate" in (outcome.fallback_reason or "") or outcome.strategy_used == "predict"


def test_predictive_tries_the_cap_directly_when_the_estimate_clears_it():
    from autobatch.probe.searching.predict import LinearFit, predictive

    passes, calls = _oracle(800)
    outcome = predictive(passes, lambda units: units * 1000, 1, 500, 1_000_000, prior=LinearFit(0.0, 1000.0))
    assert outcome.units == 500 and calls == [(500, "estimate")]


def test_strategy_estimate_applies_margin_and_reports_no_fit():
    step = make_mlp_step(width=128)
    full = find_max_batch(step, strategy="estimate", memory_limit="16MiB", multiple_of=4)
    reduced = find_max_batch(step, strategy="estimate", memory_limit="16MiB", multiple_of=4, margin=0.1)
    assert full.batch_size % 4 == 0 and reduced.batch_size % 4 == 0
    assert reduced.batch_size <= full.batch_size * 0.9 and not reduced.tested
    with pytest.raises(autobatch.NoBatchFitsError, match="is estimated to peak at .* no trial ran"):
        find_max_batch(step, strategy="estimate", memory_limit="64KiB")


# -- cuBLAS workspaces (autobatch.memory.workspaces) ------------------------------------------------
def test_cublas_workspace_size_follows_pytorchs_rule():
    from autobatch.memory.workspaces import cublas_workspace_bytes, hipblas_workspace_bytes

    MiB, KiB = 2**20, 2**10
    assert cublas_workspace_bytes(9) == cublas_workspace_bytes(10) == cublas_workspace_bytes(12) == 32 * MiB
    assert cublas_workspace_bytes(8) == cublas_workspace_bytes(7) == 8 * MiB + 128 * KiB  # ":4096:2:16:8"
    assert cublas_workspace_bytes(9, ":4096:8") == 32 * MiB
    assert cublas_workspace_bytes(8, ":4096:2:16:8") == 8 * MiB + 128 * KiB
    assert cublas_workspace_bytes(9, ":16:8") == 128 * KiB  # deterministic-algorithms setting
    assert cublas_workspace_bytes(9, "garbage") == 32 * MiB  # unparsable: PyTorch's default
    assert hipblas_workspace_bytes("gfx942:sramecc+:xnack-") == 128 * MiB
    assert hipblas_workspace_bytes("gfx90a") == 32 * MiB


def test_matrix_products_are_seen_on_each_thread_that_runs_them():
    """Forward and backward of a linear layer both multiply matrices; on the CPU the autograd
    engine runs backward on the caller's thread, so one thread is recorded (on CUDA, the
    engine's device thread makes it two, and two workspaces)."""
    from autobatch.memory.workspaces import BlasThreads

    layer = torch.nn.Linear(8, 4)
    with BlasThreads() as blas:
        layer(torch.randn(3, 8)).sum().backward()
    assert len(blas.threads) == 1
    with BlasThreads() as blas:
        torch.relu(torch.randn(3, 8)).sum()
    assert not blas.threads


def test_no_workspace_is_added_off_cuda():
    estimate = estimate_memory(make_mlp_step(width=32, in_features=8), 16)
    assert estimate.workspace_bytes == 0
    assert estimate.peak_bytes == estimate.resident_bytes + estimate.step_peak_bytes
