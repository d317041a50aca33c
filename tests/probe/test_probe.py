"""find_max_batch: strategies, bounds, errors, restore and memory hygiene (CPU)."""

import gc

import pytest
import torch
from torch import nn

import autobatch
from autobatch import NoBatchFitsError, ProbeResult, TrainStep, find_max_batch, simulated_memory
from autobatch.memory.devices import SimulatedDeviceMemory
from autobatch.probe.trial import TrialRunner

from gc_recording import Cycle, collections
from workloads import ThresholdStep, make_mlp_step

# (strategy, threshold, expected batch, expected number of trials) with default start/max.
CASES = [
    ("binary", 100, 100, 14),  # 1..64 pass, 128 OOM, bisect 96 112 104 100 102 101
    ("binary", 64, 64, 14),  # a power of two: 1..64, 128, then 96 80 72 68 66 65
    ("binary", 1, 1, 2),
    ("auto", 100, 100, 12),  # flat peaks: predict starts at 8, grows 64, 512 (OOM), then bisects
    ("power", 100, 64, 8),  # 1..64 pass, 128 OOM
    ("power", 64, 64, 8),
    ("power", 1, 1, 2),
    ("halving", 100, 64, 5),  # 1024 512 256 128 OOM, 64 pass
    ("halving", 64, 64, 5),
    ("halving", 1500, 1024, 1),
]


@pytest.mark.parametrize("strategy, threshold, expected, trials", CASES)
def test_strategies_on_a_known_boundary(strategy, threshold, expected, trials):
    fn = ThresholdStep(threshold)
    result = find_max_batch(fn, strategy=strategy, steps_per_trial=1)
    assert result.batch_size == expected
    assert result.num_trials == trials
    assert result.strategy == strategy
    assert result.strategy_used == ("binary" if strategy == "auto" else strategy)  # auto: no curve to fit
    passed = {t.batch_size for t in result.trials if t.passed}
    assert result.batch_size in passed  # never an untested size
    assert len(fn.calls) == trials  # each size tried once


@pytest.mark.parametrize("threshold", [3, 37, 100, 128, 1000, 4095])
def test_binary_is_exact_for_any_boundary(threshold):
    result = find_max_batch(ThresholdStep(threshold), strategy="binary", steps_per_trial=1)
    assert result.batch_size == threshold
    assert result.smallest_failed == threshold + 1


def test_power_and_halving_land_on_their_grid_below_the_boundary():
    for threshold in (5, 37, 100, 1000):
        power = find_max_batch(ThresholdStep(threshold), strategy="power", start=3, steps_per_trial=1)
        assert power.batch_size <= threshold < 2 * power.batch_size and power.batch_size % 3 == 0
        halving = find_max_batch(ThresholdStep(threshold), strategy="halving", start=3000, steps_per_trial=1)
        assert halving.batch_size <= threshold < 2 * halving.batch_size


def test_start_above_the_boundary_halves_then_bisects():
    fn = ThresholdStep(100)
    result = find_max_batch(fn, strategy="binary", start=500, steps_per_trial=1)
    assert result.batch_size == 100
    assert fn.calls[:4] == [500, 250, 125, 62]


def test_max_batch_caps_the_search_and_is_returned_when_it_passes():
    fn = ThresholdStep(1000)
    result = find_max_batch(fn, strategy="binary", max_batch=300, steps_per_trial=1)
    assert result.batch_size == 300
    assert max(fn.calls) == 300
    assert result.smallest_failed is None and result.hit_max_batch
    assert result.num_trials == 10  # 1..256, then 300


def test_multiple_of_rounds_every_size_down():
    fn = ThresholdStep(100)
    result = find_max_batch(fn, strategy="binary", multiple_of=8, steps_per_trial=1)
    assert result.batch_size == 96
    assert all(size % 8 == 0 for size in fn.calls)
    capped = find_max_batch(ThresholdStep(1000), multiple_of=8, max_batch=100, steps_per_trial=1)
    assert capped.batch_size == 96  # max_batch rounded down to a multiple


def test_margin_is_applied_last_and_verified_by_a_trial():
    fn = ThresholdStep(100)
    result = find_max_batch(fn, strategy="binary", margin=0.1, steps_per_trial=1)
    assert result.largest_passed == 100
    assert result.batch_size == 90
    assert result.trials[-1].batch_size == 90 and result.trials[-1].purpose == "margin"
    assert result.trials[-1].passed
    assert result.margin == 0.1


def test_a_trial_runs_every_step_and_stops_at_the_first_oom():
    fn = ThresholdStep(4)
    find_max_batch(fn, strategy="power", steps_per_trial=3, search_steps=None)
    assert fn.calls == [1, 1, 1, 2, 2, 2, 4, 4, 4, 8]


def test_search_trials_run_one_step_and_the_answer_a_full_trial():
    fn = ThresholdStep(4)
    result = find_max_batch(fn, strategy="power", steps_per_trial=3)
    # the first trial is full (lazy state); 2, 4 and 8 only find the side of the boundary;
    # 4 was a one-step pass, so it is confirmed with a full trial
    assert fn.calls == [1, 1, 1, 2, 4, 8, 4, 4, 4]
    assert [(t.batch_size, t.steps, t.purpose) for t in result.trials][-1] == (4, 3, "confirm")
    assert result.batch_size == 4


def test_a_size_next_to_a_failure_runs_full_at_once():
    fn = ThresholdStep(11)
    result = find_max_batch(fn, strategy="binary", steps_per_trial=2)
    # 16 and 12 failed, 10 passed one step; 11 is tried after 12 failed, so it may be the
    # answer and its own trial is full: no confirm trial
    assert [t.batch_size for t in result.trials] == [1, 2, 4, 8, 16, 12, 10, 11]
    assert [t.purpose for t in result.trials].count("confirm") == 0
    last = result.trials[-1]
    assert (last.batch_size, last.passed, last.steps) == (11, True, 2)
    assert result.batch_size == 11


def test_late_oom_in_the_full_trial_steps_down():
    """A size that passes one step but not three (memory that grows step by step) is not
    returned: the full trial fails and the answer steps down until a full trial passes."""

    class Growing:
        def __init__(self):
            self.used = 0

        def __call__(self, size):
            self.used = self.used + 1 if size == getattr(self, "last", None) else 1
            self.last = size
            if size * self.used > 30:  # one step of 16 fits, three do not
                raise torch.OutOfMemoryError("CUDA out of memory (test)")

    result = find_max_batch(Growing(), strategy="power", steps_per_trial=3)
    assert result.batch_size * 3 <= 30 < (result.batch_size + 1) * 3  # the confirmation bisected back to 10
    assert any(t.batch_size == result.batch_size and t.passed and t.steps == 3 for t in result.trials)


def test_search_steps_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="search_steps"):
        find_max_batch(ThresholdStep(4), search_steps=0)


def test_non_oom_errors_propagate_unchanged():
    class ShapeBug(Exception):
        pass

    def fn(batch_size):
        if batch_size >= 4:
            raise ShapeBug("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(ShapeBug):
        find_max_batch(fn, steps_per_trial=1)

    def runtime(batch_size):
        raise RuntimeError("CUDA error: device-side assert triggered")

    with pytest.raises(RuntimeError, match="device-side assert"):
        find_max_batch(runtime, steps_per_trial=1)

    def interrupted(batch_size):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        find_max_batch(interrupted, steps_per_trial=1)


def test_nothing_fits_raises_a_memory_error_with_figures_and_advice():
    with pytest.raises(NoBatchFitsError) as info:
        find_max_batch(ThresholdStep(0), steps_per_trial=1, memory_limit="1GiB")
    error = info.value
    assert isinstance(error, MemoryError)
    assert not autobatch.is_oom_error(error)
    message = str(error)
    assert "batch 1" in message and "capacity 1.00 GiB" in message
    assert "gradient accumulation" in message and "checkpointing" in message and "precision" in message
    assert "CUDA out of memory" in message  # the last allocator error


def test_multiple_of_that_never_fits_names_multiple_of():
    with pytest.raises(NoBatchFitsError, match="multiple_of=8"):
        find_max_batch(ThresholdStep(5), multiple_of=8, steps_per_trial=1)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"start": 0}, "start"),
        ({"start": -3}, "start"),
        ({"start": 2.5}, "start"),
        ({"max_batch": 0}, "max_batch"),
        ({"multiple_of": 0}, "multiple_of"),
        ({"multiple_of": -8}, "multiple_of"),
        ({"start": 64, "max_batch": 32}, "start=64 is larger than max_batch=32"),
        ({"margin": 1.0}, "margin"),
        ({"margin": -0.1}, "margin"),
        ({"steps_per_trial": 0}, "steps_per_trial"),
        ({"strategy": "fastest"}, "strategy must be one of auto, predict, binary, power, halving"),
        ({"memory_limit": "a lot"}, "memory_limit"),
        ({"max_batch": 4, "multiple_of": 8}, "max_batch=4 is smaller than multiple_of=8"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_argument(kwargs, name):
    fn = ThresholdStep(10)
    with pytest.raises(ValueError, match=name):
        find_max_batch(fn, **kwargs)
    assert fn.calls == []  # rejected before any trial


def test_result_round_trips_through_json():
    result = find_max_batch(ThresholdStep(100), margin=0.05, steps_per_trial=1, memory_limit="1GiB")
    data = result.to_dict()
    assert data["batch_size"] == 95 and data["num_trials"] == 13  # auto: 8, 64, 512 OOM, bisect, margin
    assert {"batch_size", "passed", "peak_bytes", "seconds"} <= set(data["trials"][0])
    again = ProbeResult.from_dict(__import__("json").loads(result.to_json()))
    assert again == result
    # the command line's result.json adds its command and config: read back too (was a TypeError)
    assert ProbeResult.from_dict({**data, "command": "python -m autobatch probe", "config": {"probe": {}}}) == result
    assert "batch size      95" in result.summary()


def test_cpu_probe_without_limit_uses_a_safe_default_budget_and_says_so():
    result = find_max_batch(ThresholdStep(10), steps_per_trial=1)
    assert result.capacity_bytes <= 2 * 2**30
    assert any("simulated budget" in note for note in result.notes)
    limited = find_max_batch(ThresholdStep(10), steps_per_trial=1, memory_limit="256MiB")
    assert limited.capacity_bytes == 256 * 2**20 and limited.memory_limit_bytes == 256 * 2**20
    assert limited.notes == []


# ---- real models under the simulated device ---------------------------------------------

def test_real_model_binary_finds_the_exact_boundary_under_simulated_memory():
    step = make_mlp_step(width=256)
    with simulated_memory("24MiB"):
        result = find_max_batch(step, strategy="binary", steps_per_trial=2)
    assert result.smallest_failed == result.batch_size + 1
    assert result.batch_size not in (2**k for k in range(20))
    assert result.peak_bytes <= 24 * 2**20
    peaks = [t.peak_bytes for t in result.trials if t.passed]
    sizes = [t.batch_size for t in result.trials if t.passed]
    assert sorted(peaks) == [p for _, p in sorted(zip(sizes, peaks))]  # memory grows with batch


def test_real_model_each_strategy_under_memory_limit():
    answers = {}
    for strategy in ("binary", "power", "halving"):
        step = make_mlp_step(width=256)
        answers[strategy] = find_max_batch(
            step, strategy=strategy, memory_limit="24MiB", steps_per_trial=2, start=4096 if strategy == "halving" else None
        )
    exact = answers["binary"].batch_size
    assert answers["binary"].smallest_failed == exact + 1
    assert exact // 2 < answers["power"].batch_size <= exact
    assert exact // 2 < answers["halving"].batch_size <= exact


def _state(step):
    model = {k: v.clone() for k, v in step.model.state_dict().items()}
    grads = {k: None if p.grad is None else p.grad.clone() for k, p in step.model.named_parameters()}
    return model, grads, repr(step.optimizer.state_dict())


def test_restore_is_bit_exact_for_model_buffers_and_lazy_optimizer_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    step = autobatch.TrainStep(
        model, opt, lambda m, b: m(b).square().mean(), lambda n: torch.randn(max(n, 2), 32)
    )
    model.eval()  # a flag the probe must not leave changed
    params_before, grads_before, opt_before = _state(step)
    rng_before = torch.get_rng_state()
    result = find_max_batch(step, memory_limit="8MiB", steps_per_trial=2)
    assert result.num_trials >= 3 and result.num_ooms >= 1  # auto: estimate-placed trial, verify, OOM
    params_after, grads_after, opt_after = _state(step)
    assert params_before.keys() == params_after.keys()
    for key in params_before:
        assert torch.equal(params_before[key], params_after[key]), key  # incl. BatchNorm running stats
    assert all(g is None for g in grads_after.values())
    assert opt_before == opt_after and len(opt.state) == 0  # Adam moments created by trials are gone
    assert not model.training
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_restore_with_existing_optimizer_state():
    step = make_mlp_step(width=64, optimizer="sgd")
    step(8)  # momentum buffers now exist
    before = _state(step)
    find_max_batch(step, memory_limit="4MiB", steps_per_trial=2)
    after = _state(step)
    for key in before[0]:
        assert torch.equal(before[0][key], after[0][key])
    assert before[2] == after[2]


def test_memory_returns_to_its_level_before_an_oom_trial():
    step = make_mlp_step(width=256)
    with simulated_memory("20MiB") as device:
        runner = TrialRunner(step, SimulatedDeviceMemory(device), steps=2, after_oom=step.clear_grads)
        assert runner(8)  # creates Adam state: the level a later trial starts from
        gc.collect()
        before = device.current_bytes
        assert not runner(100_000)  # OOMs part-way through forward/backward
        assert device.current_bytes == before
        assert runner.records[-1].error.startswith("Simulated out of memory")
        assert runner.records[-1].peak_bytes <= 20 * 2**20


def test_probe_leaves_no_memory_behind():
    step = make_mlp_step(width=256)
    with simulated_memory("20MiB") as device:  # a memory_limit of another size in here is refused
        before = device.current_bytes
        find_max_batch(step, steps_per_trial=2)
        gc.collect()
        assert device.current_bytes == before


# ---- the snapshot copied in the background -----------------------------------------------

def _slow_copy(monkeypatch, seconds=0.3):
    """Delay the background copy, so the optimizer step surely arrives while it runs."""
    import time

    from autobatch.probe.snapshot.restore import Snapshot

    original = Snapshot._copy_in_background

    def slow(self, after, params):
        time.sleep(seconds)
        original(self, after, params)

    monkeypatch.setattr(Snapshot, "_copy_in_background", slow)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_background_snapshot_holds_the_weights_from_before_the_optimizer_step(monkeypatch, optimizer):
    from autobatch.probe.snapshot.restore import Snapshot

    _slow_copy(monkeypatch)
    step = make_mlp_step(width=64, optimizer=optimizer)
    if optimizer == "sgd":
        step(8)  # momentum buffers exist before the snapshot
    before = _state(step)
    snapshot = Snapshot.take(step.model, step.optimizer, background=True)
    step(8)  # its optimizer step waits for the copy, then changes every weight
    assert any(not torch.equal(before[0][k], v) for k, v in step.model.state_dict().items())
    snapshot.restore()
    after = _state(step)
    for key in before[0]:
        assert torch.equal(before[0][key], after[0][key]), key
    assert before[2] == after[2]
    assert not step.optimizer._optimizer_step_pre_hooks  # the waiting hook removed itself


def test_a_probe_of_a_train_step_copies_its_weights_in_the_background(monkeypatch):
    _slow_copy(monkeypatch)
    step = make_mlp_step(width=64)
    step(8)  # Adam's moments exist: a step at learning rate 0 would change them, so they are copied
    before = _state(step)
    find_max_batch(step, memory_limit="4MiB", steps_per_trial=2, cache=False)
    after = _state(step)
    for key in before[0]:
        assert torch.equal(before[0][key], after[0][key]), key
    assert before[2] == after[2] and not step.optimizer._optimizer_step_pre_hooks


def test_a_failed_background_copy_stops_the_probe_with_its_error(monkeypatch):
    from autobatch.probe.snapshot.restore import Snapshot

    def broken(self, after, params):
        raise MemoryError("host memory exhausted")

    monkeypatch.setattr(Snapshot, "_copy_in_background", broken)
    step = make_mlp_step(width=64)
    step(8)  # state exists: the weights are copied (a fresh optimizer would step at learning rate 0)
    before = _state(step)
    with pytest.raises(RuntimeError, match="could not snapshot the model before probing: host memory"):
        find_max_batch(step, memory_limit="4MiB", steps_per_trial=2, cache=False)
    after = _state(step)  # the optimizer step never ran: the weights are the user's
    for key in before[0]:
        assert torch.equal(before[0][key], after[0][key]), key


# ---- what a failed trial leaves: young garbage, live state, old garbage ----------------------


@pytest.mark.parametrize("kept, full", [(3 * 2**20, 1), (512 * 2**10, 0)])
def test_live_leftover_after_an_oom_costs_one_full_collection_at_most(monkeypatch, kept, full):
    """What a plain callable keeps past its OOM outside any optimizer (outputs a list holds) is
    live state, not garbage: the trials after it make quick collections, one full collection finds
    it frees nothing, and none follows. Under ``LIVE_SLACK`` (buffers a library makes on a step's
    first use) no full collection looks for it at all."""
    held: list[torch.Tensor] = []

    def step(batch_size: int) -> None:  # a failing call leaves something held
        if batch_size > 256 and not held:
            held.append(torch.empty(kept, dtype=torch.uint8))
        torch.empty(batch_size * 2**16, dtype=torch.uint8)

    made = collections(monkeypatch)
    with simulated_memory("16MiB"):
        result = find_max_batch(step, strategy="binary", steps_per_trial=1)
    assert sum(not record.passed for record in result.trials) >= 3
    assert made.count(2) == full and made.count(1) >= 1 + full, made


def test_gradients_and_state_a_failed_trial_leaves_cost_no_collection(monkeypatch):
    """The gradients a failed backward left and the optimizer state earlier steps made are live
    (the optimizer's own), not garbage: no trial collects for them, where each failure made a
    quick collection and the second a full one (0.05-0.15 s on a GPU host)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    optimizer = torch.optim.Adam(model.parameters())

    def step(batch_size: int) -> None:
        model(torch.randn(batch_size, 256)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    made = collections(monkeypatch)
    with simulated_memory("32MiB"):
        result = find_max_batch(step, strategy="binary", steps_per_trial=2)
    assert sum(not record.passed for record in result.trials) >= 3
    assert made == [], made


def test_old_garbage_left_by_an_oom_cannot_fail_a_size(monkeypatch):
    """A failed call leaves a reference cycle holding 4 MiB in the oldest generation (as a model
    built inside a plain callable can): the quick collections miss it, so a later trial fails
    beside it; the full collection that follows frees it and that size runs again. The answer
    is the one found with no such garbage (halving from 512: 512 fails and litters, 256 fits
    only without the litter)."""
    def make_step(litter: bool):
        littered: list[int] = []

        def step(batch_size: int) -> None:
            if litter and batch_size > 300 and not littered:
                holder = [Cycle(torch.empty(4 * 2**20, dtype=torch.uint8))]
                gc.collect()  # survives (held): promoted to the oldest generation
                holder.clear()  # now garbage that only a full collection frees
                littered.append(batch_size)
            torch.empty(batch_size * 2**16, dtype=torch.uint8)

        return step

    with simulated_memory("16MiB"):
        clean = find_max_batch(make_step(False), strategy="halving", start=512, steps_per_trial=1).batch_size
    made = collections(monkeypatch)
    with simulated_memory("16MiB") as device:
        before = device.current_bytes
        littered = find_max_batch(make_step(True), strategy="halving", start=512, steps_per_trial=1)
        gc.collect()
        assert device.current_bytes == before
    assert littered.batch_size == clean == 256
    assert [r.batch_size for r in littered.trials][:2] == [512, 256] and 2 in made


def test_an_fp16_probe_puts_the_grad_scalers_scale_back():
    """fp16 trials whose scaled gradients overflow halve the GradScaler's scale (65536 -> 1024
    here); the scaler is the user's, so the probe puts its scale and growth tracker back."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    optimizer = torch.optim.Adam(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    step = TrainStep(model, optimizer, lambda m, b: (m(b) * 1e4).square().mean(), lambda n: torch.randn(n, 64),
                     autocast_dtype=torch.float16, grad_scaler=scaler)
    before = scaler.state_dict()
    with simulated_memory("4MiB"):
        find_max_batch(step, cache=False)
    assert scaler.state_dict() == before
    step(8)  # and it trains on: the optimizer is not left marked as unscaled
    assert scaler.get_scale() < before["scale"]  # this step overflowed as the trials did


def test_a_trial_that_fails_after_unscaling_leaves_the_scaler_ready_for_the_next():
    """An OOM inside the optimizer step, after GradScaler.unscale_: the next step must unscale
    its own gradients again, not reuse the failed step's inf check."""
    from torch.amp.grad_scaler import OptState

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)  # no overflow: the optimizer step runs
    step = TrainStep(model, optimizer, lambda m, b: m(b).square().mean(), lambda n: torch.randn(n, 8),
                     autocast_dtype=torch.float16, grad_scaler=scaler)

    def fail(*_args, **_kwargs):
        raise torch.OutOfMemoryError("out of memory inside the optimizer step")

    hook = optimizer.register_step_pre_hook(fail)
    with pytest.raises(torch.OutOfMemoryError):
        step(4)
    hook.remove()
    assert scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.UNSCALED
    step.clear_grads()  # what the probe does after an OOM trial
    assert scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY


def test_an_autotuned_answer_says_how_a_new_process_should_autotune(monkeypatch):
    """With cuDNN autotuning the answer's note says what a new process does (it autotunes again)
    and warns against an untuned first step, whose plans PyTorch would keep for good."""
    from types import SimpleNamespace

    from autobatch.probe import promise

    figures = {"batch_size": 180, "steps": 4, "after_last_oom": True, "autotuned": True, "step_peak_bytes": 2**30,
               "peak_fraction": 0.98, "reserved_peak_bytes": 2**30, "fragmentation_bytes": 0,
               "inactive_split_bytes": 0, "expandable_segments": False, "capacity_bytes": 2**30 + 2**24,
               "allocator_headroom_bytes": 2**24}
    runner = SimpleNamespace(peak_limit=2**30, settle_final=True)
    result = SimpleNamespace(promise=None)
    monkeypatch.setattr(promise, "promise_of", lambda *a: dict(figures))
    note = promise.promise_note(runner, result, memory=None)
    assert "with cuDNN autotuning on" in note and note.endswith(promise.NEW_PROCESS_AUTOTUNING)
    assert "tuned for real" in note and "whatever the flag" in note and "expandable_segments" in note
    assert "passing trials left 16.00 MiB (1.5 % of capacity) free" in note
    monkeypatch.setattr(promise, "promise_of", lambda *a: dict(figures, autotuned=False))
    assert promise.NEW_PROCESS_AUTOTUNING not in promise.promise_note(runner, result, memory=None)


@pytest.mark.parametrize(
    ("autotuned", "steps", "flushes", "warned"),
    [(False, 4, 3, True), (False, 4, 2, False), (False, 3, 0, False), (False, 3, None, False), (True, 5, 4, False)],
)
def test_an_answer_whose_every_step_flushed_warns_a_hand_loop(monkeypatch, autotuned, steps, flushes, warned):
    """An untuned answer whose every step after the first flushed the allocator's cache sits at
    the wall (an H100 ran a hand loop out of memory there at step 14): the note says so and what
    to do. Not where a step stopped flushing, nor where the device counts no flushes, nor with
    autotuning (its confirmation already steps until flushing stops)."""
    from autobatch.probe import promise

    figures, note = _flushing_note(monkeypatch, steps=steps, flushes=flushes, autotuned=autotuned, expandable=False)
    assert (promise.STILL_FLUSHING in note) is warned
    assert promise.still_flushing(figures) is warned


def _flushing_note(monkeypatch, *, steps, flushes, autotuned, expandable):
    """A promise's figures for an answer whose trial ran ``steps`` steps, ``flushes`` of them after
    the first flushing the allocator's cache, and the note ``promise_note`` makes of them."""
    from types import SimpleNamespace

    from autobatch.probe import promise

    figures = {"batch_size": 180, "steps": steps, "after_last_oom": True, "autotuned": autotuned, "flushes": flushes,
               "step_peak_bytes": 2**30, "peak_fraction": 0.98, "reserved_peak_bytes": 2**30,
               "fragmentation_bytes": 0, "inactive_split_bytes": 0, "expandable_segments": expandable,
               "capacity_bytes": 2**30 + 2**24, "allocator_headroom_bytes": 2**24}
    runner = SimpleNamespace(peak_limit=2**30, settle_final=True)
    monkeypatch.setattr(promise, "promise_of", lambda *a: dict(figures))
    return figures, promise.promise_note(runner, SimpleNamespace(promise=None), memory=None)


@pytest.mark.parametrize(
    ("expandable", "autotuned", "steps", "flushes", "warned"),
    [(False, False, 4, 2, True), (False, False, 6, 4, True), (False, False, 4, 1, False), (True, False, 4, 2, False),
     (False, True, 5, 2, False), (False, False, 4, 3, False), (False, False, 4, None, False)],
)
def test_an_answer_some_of_whose_steps_flushed_under_fixed_segments_says_a_new_process_may_not(
        monkeypatch, expandable, autotuned, steps, flushes, warned):
    """ViT-B/32 as a plain callable on an H200 (8 GiB cap, fixed segments): 376's trial flushed in
    two of its three steps after the first and trained in the probing process; a new process ran out
    of memory at step 3, where 373 trained. Two or more flushing steps (not all: that is
    STILL_FLUSHING's note) under fixed segments, untuned, get a note naming expandable segments;
    one flushing step, expandable segments, or autotuning (its confirmation steps on) do not."""
    from autobatch.probe import promise

    figures, note = _flushing_note(monkeypatch, steps=steps, flushes=flushes, autotuned=autotuned, expandable=expandable)
    assert (promise.AT_FIXED_WALL in note) is warned
    assert promise.at_fixed_wall(figures) is warned
    if warned:
        assert f"{flushes} of its {steps - 1} steps after the first flushed" in note
        assert "expandable_segments:True" in note


def test_hand_loop_defaults_to_the_step_type_and_is_checked(monkeypatch):
    """Who trains the answer decides whether a still-flushing trial fails (docs/promise.md,
    "Resumed runs"): a plain callable's own loop (True) unless told, a TrainStep's Runner (False)
    unless told; the setting reaches the trials and the search, and it is part of the cache key."""
    import autobatch.probe.find as find

    seen = []
    real = find.TrialRunner

    def spy(*args, **kwargs):
        seen.append(kwargs["hand_loop"])
        return real(*args, **kwargs)

    monkeypatch.setattr(find, "TrialRunner", spy)
    step = make_mlp_step()
    with simulated_memory("16MiB"):
        find_max_batch(ThresholdStep(40), strategy="binary")
        find_max_batch(ThresholdStep(40), strategy="binary", hand_loop=False)
        find_max_batch(step, strategy="binary", cache=False)
        find_max_batch(step, strategy="binary", cache=False, hand_loop=True)
    assert seen == [True, False, False, True]
    with pytest.raises(TypeError, match="hand_loop must be True, False or None"):
        find_max_batch(ThresholdStep(40), hand_loop="yes")


def test_hand_loop_is_part_of_the_cache_key(tmp_path):
    step = make_mlp_step()
    with simulated_memory("16MiB"):
        first = find_max_batch(step, strategy="binary", cache=tmp_path)
        other = find_max_batch(step, strategy="binary", cache=tmp_path, hand_loop=True)
        again = find_max_batch(step, strategy="binary", cache=tmp_path, hand_loop=True)
    assert not first.cached and not other.cached and again.cached


def test_a_plain_callable_that_builds_its_model_in_each_call_is_probed_exactly():
    """Each trial's model and optimizer die with the trial (the step watch holds optimizers
    weakly): the trials do not pile up, and auto finds what binary finds."""
    vocab, seq = 8192, 32

    def fn(batch_size):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(vocab, 64), torch.nn.Linear(64, vocab))
        optimizer = torch.optim.AdamW(model.parameters())
        x = torch.randint(0, vocab, (batch_size, seq))
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        optimizer.step()

    auto = find_max_batch(fn, memory_limit="40MiB", cache=False)
    binary = find_max_batch(fn, memory_limit="40MiB", cache=False, strategy="binary")
    assert auto.batch_size == binary.batch_size > 1


def test_every_random_generator_a_make_batch_draws_from_is_put_back(tmp_path):
    """make_batch may draw from torch's, Python's and NumPy's generators, and the cache key builds
    batches (for real where fake tensors cannot run, as with padding to the longest sampled
    length) before the snapshot is taken: after the probe, cached or not, all three are as before."""
    import random

    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 2))

    def make_batch(n):
        longest = int(torch.randint(5, 20, (n,)).max()) + random.randint(0, 3) + int(np.random.randint(0, 3))
        return torch.randint(0, 50, (n, longest)), torch.randint(0, 2, (n,))

    step = autobatch.TrainStep(model, torch.optim.Adam(model.parameters()),
                               lambda m, b: torch.nn.functional.cross_entropy(m(b[0]).mean(1), b[1]), make_batch)
    for cache in (False, tmp_path):
        torch_state, python_state, numpy_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
        autobatch.find_max_batch(step, memory_limit="4MiB", cache=cache, max_batch=256)
        assert torch.equal(torch.get_rng_state(), torch_state)
        assert random.getstate() == python_state
        assert np.array_equal(np.random.get_state()[1], numpy_state[1])


def test_a_weight_written_outside_the_optimizer_that_the_probe_could_not_put_back_is_named():
    """A fresh SGD's trials step at learning rate 0 and copy no weight: an EMA teacher updated in
    the loss (not held by the optimizer) or a clamp of the optimizer's own weights in the loss
    keeps the trials' changes. The probe cannot tell those weights from a frozen backbone's
    beforehand; afterwards their version counters say so, and a warning names them."""
    import copy
    import warnings

    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.student = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
            self.teacher = copy.deepcopy(self.student).requires_grad_(False)

    def ema_loss(m, b):
        with torch.no_grad():
            for t, s in zip(m.teacher.parameters(), m.student.parameters()):
                t.mul_(0.99).add_(s, alpha=0.01)
        return (m.student(b) - m.teacher(b)).square().mean()

    def clamping_loss(m, b):
        with torch.no_grad():
            for p in m.student.parameters():
                p.clamp_(-0.01, 0.01)
        return m.student(b).square().mean()

    def plain_loss(m, b):
        return m.student(b).square().mean()

    for loss, written in ((ema_loss, "teacher.0.weight"), (clamping_loss, "student.0.weight"), (plain_loss, None)):
        torch.manual_seed(0)
        model = Pair()
        with torch.no_grad():
            model.student[0].weight.add_(0.5)
        step = TrainStep(model, torch.optim.SGD(model.student.parameters(), lr=0.1), loss, lambda n: torch.randn(n, 8))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            find_max_batch(step, memory_limit="2MiB", cache=False, max_batch=512)
        said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        if written is None:
            assert not said  # only the optimizer wrote the weights: nothing to say
        else:
            assert len(said) == 1 and written in said[0] and "outside optimizer.step()" in said[0]


def test_a_start_above_the_answer_runs_full_trials_until_one_passes():
    """A first trial that runs out of memory creates no lazy state (AdamW's moments): the first
    passing trial after it ran one step, without that state, passed a size that cannot train,
    and the search bisected the wrong bracket and stepped down 1 % per OOM (30 trials, answer
    one short)."""
    def make():
        torch.manual_seed(0)
        block = lambda: nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.LayerNorm(128))
        model = nn.Sequential(nn.Linear(64, 128), *[block() for _ in range(4)], nn.Linear(128, 10))
        return TrainStep(model, torch.optim.AdamW(model.parameters()), lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
                         lambda n: (torch.randn(n, 64), torch.randint(0, 10, (n,))))

    default = find_max_batch(make(), memory_limit="8MiB", cache=False, strategy="predict")
    for strategy in ("predict", "binary"):
        high = find_max_batch(make(), memory_limit="8MiB", cache=False, strategy=strategy, start=5000)
        first_pass = next(trial for trial in high.trials if trial.passed)
        assert first_pass.steps == 3 and high.batch_size == default.batch_size
        assert high.num_trials <= 16
