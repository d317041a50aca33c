"""The OOM-resilient runner: replays lose no sample and change no weight.

Every comparison is against an uninjected run over the same global batches, in float64;
after an OOM the micro-batch halves, so the two runs split the global batch differently and
differ only in floating-point summation order. Tolerance: ``rtol=1e-10, atol=1e-12``.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import autobatch
from autobatch import FaultInjector, Runner, StepOutOfMemoryError, inject_oom
from autobatch.planning.checkpointing import is_checkpointed
from autobatch.training.oom.faults import PHASES
from runner_workloads import SampleTracker, assert_weights_close, hungry_mse, make_data, make_model, mse, weights

GLOBAL, MICRO, SAMPLES, EPOCHS = 16, 8, 48, 2
STEPS = SAMPLES // GLOBAL * EPOCHS  # 6 global steps
WHEN = {"first": 0, "middle": STEPS // 2, "last": STEPS - 1}


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def run(faults=None, *, make_optimizer=adam, track=False, loss_fn=mse, **options):
    model = make_model()
    optimizer = make_optimizer(model)
    tracker = SampleTracker(optimizer, GLOBAL) if track else None
    loss_fn = tracker.loss_fn if track else loss_fn
    options = {"global_batch": GLOBAL, "micro_batch": MICRO, "progress": False, **options}
    runner = Runner(model, optimizer, loss_fn, faults=faults, **options)
    result = runner.fit(make_data(SAMPLES, GLOBAL), epochs=EPOCHS)
    return runner, result, tracker


@pytest.fixture(scope="module")
def reference():
    runner, result, _ = run()
    assert result.oom_recoveries == []
    return weights(runner.model)


# -- acceptance: every phase x (first, middle, last step) x (once, repeated) ----------------------
@pytest.mark.parametrize("times", [1, 2], ids=["once", "repeated"])
@pytest.mark.parametrize("when", list(WHEN))
@pytest.mark.parametrize("phase", PHASES)
def test_injected_oom_changes_nothing(reference, phase, when, times):
    step = WHEN[when]
    faults = FaultInjector((step, phase), times=times)
    if phase == "optimizer" and times > 1:  # replayed once at the same micro-batch, then given up (optimizer_phase)
        with pytest.raises(StepOutOfMemoryError, match="again when the step was replayed at the same micro-batch"):
            run(faults, track=True)
        return
    runner, result, tracker = run(faults, track=True)
    halvings = 0 if phase == "optimizer" else times  # the micro-batch does not size the optimizer step

    assert faults.fired == [(step, phase)] * times
    assert [(r["step"], r["phase"]) for r in result.oom_recoveries] == [(step, phase)] * times
    assert [r["micro_batch"] for r in result.oom_recoveries] == [MICRO // 2**min(k, halvings) for k in range(1, times + 1)]
    assert result.steps == STEPS and result.micro_batch == MICRO // 2**halvings
    assert_weights_close(weights(runner.model), reference)
    # One applied update per global batch; every sample in exactly one update per epoch.
    assert len(tracker.applied) == STEPS
    per_epoch = STEPS // EPOCHS
    for epoch in range(EPOCHS):
        ids = [i for update in tracker.applied[epoch * per_epoch : (epoch + 1) * per_epoch] for i in update]
        assert sorted(ids) == list(range(SAMPLES))


def test_optimizer_steps_once_per_global_batch():
    model = make_model()
    optimizer = adam(model)
    calls = []
    optimizer.register_step_post_hook(lambda *a: calls.append(1))
    Runner(model, optimizer, mse, global_batch=GLOBAL, micro_batch=4, progress=False).fit(make_data(), epochs=1)
    assert len(calls) == SAMPLES // GLOBAL


# -- an OOM *inside* optimizer.step() -------------------------------------------------------------
class OOMAfterStep:
    """A step post-hook that raises a real OOM once: the whole update is already applied."""

    def __init__(self, at_call: int) -> None:
        self.at_call, self.calls = at_call, 0

    def __call__(self, optimizer, args, kwargs) -> None:
        self.calls += 1
        if self.calls == self.at_call:
            raise torch.OutOfMemoryError("CUDA out of memory (test: after the update was applied)")


class GroupwiseSGD(torch.optim.SGD):
    """SGD that applies the real update one parameter group at a time and can OOM between
    groups: a half-applied update (group 0's parameters and momentum written, group 1's not)."""

    fail_at_call: int | None = None

    def step(self, closure=None):
        self.calls = getattr(self, "calls", 0) + 1
        groups = self.param_groups
        for index, group in enumerate(groups):
            self.param_groups = [group]
            try:
                super().step()
            finally:
                self.param_groups = groups
            if index == 0 and self.calls == self.fail_at_call:
                raise torch.OutOfMemoryError("CUDA out of memory (test: between parameter groups)")


def grouped_sgd(model):
    params = list(model.parameters())
    return GroupwiseSGD([{"params": params[:2]}, {"params": params[2:]}], lr=0.05, momentum=0.9)


@pytest.mark.parametrize("make_optimizer", [adam, sgd], ids=["adam", "sgd-momentum"])
@pytest.mark.parametrize("at_call", [1, 4], ids=["first-step", "later-step"])
def test_oom_after_optimizer_applied_update_is_undone(make_optimizer, at_call):
    def with_hook(model):
        optimizer = make_optimizer(model)
        optimizer.register_step_post_hook(OOMAfterStep(at_call))
        return optimizer

    reference, _, _ = run(make_optimizer=make_optimizer)
    runner, result, _ = run(make_optimizer=with_hook)
    assert [(r["step"], r["phase"]) for r in result.oom_recoveries] == [(at_call - 1, "optimizer")]
    assert_weights_close(weights(runner.model), weights(reference.model))
    for left, right in zip(runner.optimizer.state.values(), reference.optimizer.state.values()):
        for key in left:
            torch.testing.assert_close(left[key], right[key], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("fail_at_call", [1, 3])
def test_half_applied_optimizer_step_is_undone(fail_at_call):
    reference, _, _ = run(make_optimizer=grouped_sgd)

    def failing(model):
        optimizer = grouped_sgd(model)
        optimizer.fail_at_call = fail_at_call
        return optimizer

    runner, result, _ = run(make_optimizer=failing)
    assert len(result.oom_recoveries) == 1 and result.oom_recoveries[0]["phase"] == "optimizer"
    assert_weights_close(weights(runner.model), weights(reference.model))


def test_without_step_guard_an_optimizer_oom_is_not_replayed():
    def failing(model):
        optimizer = grouped_sgd(model)
        optimizer.fail_at_call = 2
        return optimizer

    with pytest.raises(StepOutOfMemoryError, match="half-applied"):
        run(make_optimizer=failing, step_guard="off")
    # An injected fault *before* optimizer.step() is still safe to replay without the guard.
    _, result, _ = run(FaultInjector((1, "optimizer")), step_guard="off")
    assert len(result.oom_recoveries) == 1


def test_device_step_guard(reference):
    runner, _, _ = run(FaultInjector((2, "optimizer")), step_guard="device")
    assert_weights_close(weights(runner.model), reference)


# -- giving up, fallbacks, other errors ---------------------------------------------------------
def test_micro_batch_one_failing_raises_clear_error():
    model_before = None
    with pytest.raises(StepOutOfMemoryError) as info:
        run(FaultInjector((1, "backward"), times=None))
    error = info.value
    assert error.step == 1 and error.phase == "backward" and not error.checkpointing
    assert not autobatch.is_oom_error(error)
    assert isinstance(error.__cause__, torch.OutOfMemoryError)
    assert "micro-batch 1" in str(error) and "checkpointing_fallback" in str(error)
    del model_before


def test_checkpointing_fallback_after_micro_batch_one(reference):
    # Fails at 8, 4, 2 and 1; the fifth attempt, with checkpointing on, succeeds.
    runner, result, _ = run(FaultInjector((2, "forward"), times=4), checkpointing_fallback=True)
    assert [r["action"] for r in result.oom_recoveries] == ["halve"] * 3 + ["checkpointing"]
    assert result.checkpointing and runner.checkpoint_handle.modules
    assert all(is_checkpointed(runner.model.get_submodule(name)) for name in runner.checkpoint_handle.modules)
    assert_weights_close(weights(runner.model), reference)
    with pytest.raises(StepOutOfMemoryError) as info:
        run(FaultInjector((2, "forward"), times=None), checkpointing_fallback=True)
    assert info.value.checkpointing


def test_non_oom_errors_propagate_unchanged():
    boom = ValueError("shape mismatch")

    def broken(model, batch):
        raise boom

    model = make_model()
    runner = Runner(model, adam(model), broken, global_batch=GLOBAL, micro_batch=MICRO, progress=False)
    with pytest.raises(ValueError) as info:
        runner.fit(make_data())
    assert info.value is boom and runner.result.oom_recoveries == []


# -- real (simulated-device) OOMs and memory --------------------------------------------------------


def peak_of(micro_batch: int) -> int:
    with autobatch.simulated_memory("1GiB") as device:
        run(micro_batch=micro_batch, make_optimizer=sgd, loss_fn=hungry_mse)
        return device.peak_bytes


def test_micro_batch_far_above_max_recovers_under_a_real_budget():
    budget = (peak_of(8) + peak_of(16)) // 2  # 16 does not fit, 8 does
    with autobatch.simulated_memory(budget) as device:
        runner, result, _ = run(micro_batch=GLOBAL, make_optimizer=sgd, loss_fn=hungry_mse)
    assert device.oom_count >= 1
    first = result.oom_recoveries[0]
    # sized from the failed attempt's measured need, not halved: between 8 (fits) and 16 (does not)
    assert first["micro_batch_before"] == 16 and first["action"] == "measured" and 8 <= result.micro_batch < 16
    plain, _, _ = run(micro_batch=result.micro_batch, make_optimizer=sgd, loss_fn=hungry_mse)
    assert_weights_close(weights(runner.model), weights(plain.model))


@pytest.mark.parametrize("phase", PHASES)
def test_memory_after_recovery_returns_to_its_level(phase):
    levels = []
    with autobatch.simulated_memory("1GiB") as device:
        model = make_model()
        # the guard in host memory: "auto" moves it there after an OOM, which would lower the level
        runner = Runner(model, sgd(model), mse, global_batch=GLOBAL, micro_batch=MICRO, progress=False, step_guard="cpu")
        inject_oom(runner, (3, phase))
        runner.fit(make_data(), epochs=EPOCHS, on_step_end=lambda info: levels.append(device.current_bytes))
    assert len(runner.result.oom_recoveries) == 1
    # levels[k] is memory after step k; step 3 failed once and was replayed.
    assert levels[3] == levels[2] == levels[4] == levels[5]


def _guard_bytes(model, optimizer) -> int:
    tensors = [*model.parameters(), *(v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))]
    return sum(t.numel() * t.element_size() for t in tensors)


def test_auto_step_guard_copies_on_the_device_only_while_it_has_room_and_not_after_an_oom():
    """``step_guard="auto"``: host memory for the first (unmeasured) step, then device memory
    while a quarter of the device stays free with the copy there; after an OOM, host memory
    for the rest of the run (memory is short). A tight budget keeps it in host memory."""
    levels, placements = [], []
    with autobatch.simulated_memory("1GiB") as device:
        model = make_model()
        optimizer = torch.optim.Adam(model.parameters())
        runner = Runner(model, optimizer, mse, global_batch=GLOBAL, micro_batch=MICRO, progress=False)
        inject_oom(runner, (3, "backward"))
        runner.fit(make_data(), epochs=EPOCHS, on_step_end=lambda info: (levels.append(device.current_bytes),
                                                                          placements.append(runner.guard.placement)))
    assert runner.guard.mode == "auto"
    # step 3 ran out of memory as its backward began, before its copy: the replay's goes to the host
    assert placements[:3] == ["cpu", "device", "device"] and set(placements[3:]) == {"cpu"}
    guard = _guard_bytes(model, optimizer)
    assert levels[1] - levels[0] == guard  # the copy moved onto the (simulated) device
    assert levels[2] - levels[3] == guard  # and off it again after the OOM
    # a budget the step nearly fills: the copy stays in host memory
    tight = make_model()
    with autobatch.simulated_memory("1GiB"):
        probe_free = Runner(tight, sgd(tight), mse, global_batch=GLOBAL, micro_batch=MICRO, progress=False)
        probe_free.step_memory.spare_after = lambda extra: 0.1  # the last step left 10 % free
        probe_free.fit(make_data(), epochs=1)
    assert probe_free.guard.placement == "cpu"


def test_failed_attempt_is_freed_before_the_replay_starts():
    """The replay starts with the memory the failed attempt started with: its activations and
    gradients are not pinned by the exception's traceback (freed outside the ``except``)."""
    at_start = []
    with autobatch.simulated_memory("1GiB") as device:
        injector = FaultInjector((3, "backward"))

        def faults(step, phase):
            if step == 3 and phase == "transfer":
                at_start.append(device.current_bytes)
            injector(step, phase)

        model = make_model()
        runner = Runner(model, sgd(model), hungry_mse, global_batch=GLOBAL, micro_batch=GLOBAL, progress=False,
                        faults=faults)
        runner.fit(make_data(), epochs=EPOCHS)
    assert injector.fired == [(3, "backward")]
    assert len(at_start) == 3  # one micro-batch of 16 in the failed attempt, then two of 8
    assert at_start[1] == at_start[0]


# -- grow back --------------------------------------------------------------------------------------
def test_grow_back_after_a_transient_oom(reference):
    runner, result, _ = run(FaultInjector((1, "forward")), grow_after=2)
    assert result.grow_attempts == [{"step": 4, "from": 4, "to": 8, "held": True}]
    assert result.micro_batch == 8
    assert_weights_close(weights(runner.model), reference)


def test_grow_back_never_oscillates():
    budget = (peak_of(4) + peak_of(8)) // 2  # 8 never fits, 4 does
    data = make_data(samples=GLOBAL * 20)  # 20 steps
    with autobatch.simulated_memory(budget):
        model = make_model()
        runner = Runner(model, sgd(model), hungry_mse, global_batch=GLOBAL, micro_batch=4, max_micro_batch=8,
                        grow_after=2, progress=False)
        result = runner.fit(data)
    # Tries at step 2, then after waits of 4 and 8 OOM-free steps: back-off, no oscillation.
    assert [(a["step"], a["held"]) for a in result.grow_attempts] == [(2, False), (7, False), (16, False)]
    assert all(r["grow"] for r in result.oom_recoveries) and result.micro_batch == 4


def test_grow_back_off_and_bounded():
    _, result, _ = run(FaultInjector((0, "forward")), grow_after=None)
    assert result.grow_attempts == [] and result.micro_batch == 4
    _, result, _ = run(grow_after=1, max_micro_batch=MICRO)  # already at the ceiling
    assert result.grow_attempts == []


# -- hygiene, progress, result ----------------------------------------------------------------------
def test_empty_cache_every_n_steps_is_counted():
    _, result, _ = run(empty_cache_every=2)
    assert result.empty_cache_fires == STEPS // 2 and result.empty_cache_seconds >= 0


def test_log_lines_without_a_terminal(caplog):
    with caplog.at_level(logging.INFO, logger="autobatch"):
        _, result, _ = run(FaultInjector((1, "forward")), progress=None, log_every=2)
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("step 2/6") and "micro-batch 4 x 4" in line and "OOM recoveries 1" in line for line in lines)
    assert any("OOM at step 1 in forward with micro-batch 8" in line and "micro-batch 4" in line for line in lines)


def test_result_round_trips_through_json():
    _, result, _ = run(FaultInjector((1, "backward")))
    again = autobatch.RunResult.from_dict(__import__("json").loads(result.to_json()))
    assert again == result and again.oom_recoveries[0]["phase"] == "backward"


def test_steps_limit_and_dict_batches():
    model = make_model()
    data = [{"x": x, "y": y} for x, y, _ in make_data()]
    runner = Runner(model, adam(model), lambda m, b: mse(m, (b["x"], b["y"])), global_batch=GLOBAL,
                    micro_batch=5, progress=False)
    result = runner.fit(data, steps=4)
    assert result.steps == 4 and result.epochs == 1 and result.samples == 4 * GLOBAL


def test_train_function_takes_plain_options():
    model = make_model()
    result = autobatch.train(model, adam(model), mse, make_data(), epochs=1,
                             **{"global_batch": GLOBAL, "micro_batch": 4, "grow_after": 0, "progress": False})
    assert result.steps == SAMPLES // GLOBAL


def test_plans_the_micro_batch_when_not_given():
    budget = (peak_of(8) + peak_of(16)) // 2
    model = make_model()
    runner = Runner(model, sgd(model), hungry_mse, global_batch=GLOBAL, micro_batch=None, progress=False,
                    plan_options={"memory_limit": budget, "strategy": "binary"})
    result = runner.fit(make_data(), epochs=EPOCHS)
    assert result.plan is not None and 1 <= result.initial_micro_batch < GLOBAL
    plain, _, _ = run(micro_batch=result.initial_micro_batch, make_optimizer=sgd, loss_fn=hungry_mse)
    assert_weights_close(weights(runner.model), weights(plain.model))


def test_bad_arguments():
    model = make_model()
    with pytest.raises(ValueError, match="global_batch"):
        Runner(model, adam(model), mse, global_batch=0)
    with pytest.raises(ValueError, match="step_guard"):
        Runner(model, adam(model), mse, global_batch=4, step_guard="maybe")
    with pytest.raises(ValueError, match="phase"):
        FaultInjector((0, "loss"))


def test_bfloat16_autocast_runs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    data = [(x.float(), y.float()) for x, y, _ in make_data()]
    runner = Runner(model, adam(model), lambda m, b: nn.functional.mse_loss(m(b[0]).float(), b[1]),
                    global_batch=GLOBAL, micro_batch=8, autocast_dtype="bfloat16", progress=False)
    inject_oom(runner, (1, "backward"))
    result = runner.fit(data)
    assert result.steps == 3 and len(result.oom_recoveries) == 1 and result.last_loss == result.last_loss
