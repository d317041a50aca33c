"""strategy="predict" / "auto": same exact answer as binary search, with fewer trials."""

import math

import pytest
import torch

from autobatch import find_max_batch, simulated_memory
from autobatch.probe.searching.predict import LinearFit, predictive

from workloads import MemoryCurveStep, ThresholdStep, make_mlp_step

MiB = 2**20

CURVES = {
    "linear": lambda b: 3 * MiB + 2000 * b,
    "quadratic": lambda b: 2 * MiB + 900 * b + 0.05 * b * b,  # attention-like growth
    "rounded-blocks": lambda b: 2 * MiB * math.ceil((MiB + 3000 * b) / (2 * MiB)),  # allocator rounding
    "workspace-step": lambda b: 4 * MiB + 2500 * b + (3 * MiB if b > 700 else 0),  # a kernel switch
    "sqrt-then-linear": lambda b: 5 * MiB + 40_000 * math.sqrt(b) + 1500 * b,
}


@pytest.mark.parametrize("curve", sorted(CURVES))
@pytest.mark.parametrize("budget", ["9MiB", "24MiB", "200MiB"])
@pytest.mark.parametrize("strategy", ["predict", "auto"])
def test_same_batch_as_binary_with_strictly_fewer_trials(curve, budget, strategy):
    with simulated_memory(budget):
        binary = find_max_batch(MemoryCurveStep(CURVES[curve]), strategy="binary", steps_per_trial=1)
        predicted = find_max_batch(MemoryCurveStep(CURVES[curve]), strategy=strategy, steps_per_trial=1)
    assert predicted.batch_size == binary.batch_size
    assert predicted.num_trials < binary.num_trials
    assert predicted.strategy_used == "predict" and predicted.fallback_reason is None
    assert predicted.smallest_failed == predicted.batch_size + 1


@pytest.mark.parametrize("budget", ["3MiB", "12MiB"])
def test_real_model_auto_matches_binary_with_fewer_trials(budget):
    with simulated_memory(budget):
        binary = find_max_batch(make_mlp_step(width=128, in_features=32), strategy="binary", steps_per_trial=2)
        auto = find_max_batch(make_mlp_step(width=128, in_features=32), strategy="auto", steps_per_trial=2)
    assert auto.batch_size == binary.batch_size
    assert auto.num_trials < binary.num_trials
    assert auto.fit is not None and auto.fit["slope_bytes_per_sample"] > 0


def test_linear_curve_is_found_in_a_handful_of_trials():
    with simulated_memory("200MiB"):
        result = find_max_batch(MemoryCurveStep(CURVES["linear"]), strategy="auto", steps_per_trial=1)
    assert result.batch_size == (200 * MiB - 3 * MiB) // 2000
    assert result.num_trials == 5  # 8, a leap to 477, a leap to 21960 (fit), the jump, one OOM above it
    assert [t.purpose for t in result.trials] == ["fit", "fit", "fit", "verify", "verify"]
    assert result.num_ooms == 1 and result.trials[-2].batch_size == result.batch_size  # the jump hit it


def test_result_records_the_fitted_curve():
    with simulated_memory("24MiB"):
        result = find_max_batch(MemoryCurveStep(CURVES["linear"]), strategy="predict", steps_per_trial=1)
    fit = result.fit
    assert fit["kind"] == "linear"
    assert fit["slope_bytes_per_sample"] == pytest.approx(2000, rel=1e-6)
    assert fit["intercept_bytes"] == pytest.approx(3 * MiB, rel=1e-6)
    assert [b for b, _ in fit["measured"]] == sorted(t.batch_size for t in result.trials if t.passed)
    assert result.to_dict()["fit"] == fit


def test_flat_measurements_fall_back_to_binary_and_say_why():
    result = find_max_batch(ThresholdStep(300), strategy="auto", steps_per_trial=1, memory_limit="1GiB")
    assert result.batch_size == 300
    assert result.strategy_used == "binary"
    assert "did not grow" in result.fallback_reason


def test_decreasing_measurements_fall_back_to_binary():
    # memory falls as the batch grows (a pathological step), then a hard limit at 777
    def curve(b):
        return max(MiB, 8 * MiB - 1000 * b)

    def step(b):
        if b > 777:
            raise __import__("torch").OutOfMemoryError("CUDA out of memory")
        MemoryCurveStep(curve)(b)

    with simulated_memory("64MiB"):
        result = find_max_batch(step, strategy="predict", steps_per_trial=1)
    assert result.batch_size == 777
    assert result.strategy_used == "binary" and result.fallback_reason


def test_first_trial_oom_halves_down_then_follows_the_line():
    """A ``start`` above the boundary is halved until a size passes, and the line found by
    bisecting from there closes the gap (review 13: it handed the whole search to binary, 15 trials)."""
    with simulated_memory("24MiB"):
        binary = find_max_batch(MemoryCurveStep(CURVES["linear"]), strategy="binary", start=20_000, steps_per_trial=1)
        result = find_max_batch(MemoryCurveStep(CURVES["linear"]), strategy="auto", start=20_000, steps_per_trial=1)
    assert result.batch_size == binary.batch_size
    assert not result.trials[0].passed
    assert result.strategy_used == "predict" and result.fallback_reason is None
    assert len(result.trials) <= 8 < len(binary.trials)


def test_prediction_beyond_max_batch_returns_max_batch_tested():
    with simulated_memory("200MiB"):
        step = MemoryCurveStep(CURVES["linear"])
        result = find_max_batch(step, strategy="auto", max_batch=5000, steps_per_trial=1)
    assert result.batch_size == 5000 and result.hit_max_batch
    assert max(step.calls) == 5000
    assert result.num_ooms == 0


def test_predict_respects_multiple_of_and_margin():
    with simulated_memory("24MiB"):
        binary = find_max_batch(MemoryCurveStep(CURVES["linear"]), strategy="binary", multiple_of=16, steps_per_trial=1)
        step = MemoryCurveStep(CURVES["linear"])
        result = find_max_batch(step, strategy="predict", multiple_of=16, margin=0.1, steps_per_trial=1)
    assert result.largest_passed == binary.batch_size
    assert all(b % 16 == 0 for b in step.calls)
    assert result.batch_size == math.floor(binary.batch_size * 0.9) // 16 * 16
    assert result.trials[-1].purpose == "margin" and result.trials[-1].passed


def test_batch_one_never_fits_raises():
    from autobatch import NoBatchFitsError

    with simulated_memory("1MiB"), pytest.raises(NoBatchFitsError):
        find_max_batch(MemoryCurveStep(CURVES["linear"]), strategy="predict", steps_per_trial=1)


def test_linear_fit_helpers():
    fit = LinearFit.through([(10, 1000), (20, 2000), (30, 3000)])
    assert fit.slope == pytest.approx(100) and fit.intercept == pytest.approx(0)
    assert fit.predict_max(2550) == 25
    assert LinearFit.through([(10, 5)]) is None
    assert not LinearFit.through([(1, 5), (2, 5)]).usable


class CountingCurveStep(MemoryCurveStep):
    """A MemoryCurveStep that counts its calls (every call is one training step)."""

    def __init__(self, curve):
        super().__init__(curve)
        self.steps_run = 0

    def __call__(self, batch_size):
        self.steps_run += 1
        return super().__call__(batch_size)


@pytest.mark.parametrize("curve", sorted(CURVES))
def test_with_full_trials_longer_than_search_trials_predict_still_matches_binary(curve):
    """Default probe: search trials of one step, the answer a full trial of three."""
    with simulated_memory("24MiB"):
        binary_step, predict_step = CountingCurveStep(CURVES[curve]), CountingCurveStep(CURVES[curve])
        binary = find_max_batch(binary_step, strategy="binary", steps_per_trial=3)
        predicted = find_max_batch(predict_step, strategy="predict", steps_per_trial=3)
    assert predicted.batch_size == binary.batch_size
    assert predict_step.steps_run < binary_step.steps_run
    answer = [t for t in predicted.trials if t.batch_size == predicted.batch_size and t.passed][-1]
    assert answer.steps == 3  # the returned size passed a full trial


def test_above_the_boundary_first_when_the_answer_needs_a_full_trial():
    """An exact line: one OOM just above the boundary, then the boundary in one full trial
    (no one-step pass of it followed by a second, confirming trial)."""
    with simulated_memory("200MiB"):
        result = find_max_batch(MemoryCurveStep(CURVES["linear"]), strategy="auto", steps_per_trial=3)
    boundary = (200 * MiB - 3 * MiB) // 2000
    tail = [(t.batch_size, t.passed, t.steps) for t in result.trials[-2:]]
    assert tail == [(boundary + 1, False, 1), (boundary, True, 3)]
    assert result.num_ooms == 1 and result.batch_size == boundary
    assert all(t.steps == 1 for t in result.trials[1:-1])  # every trial but the first and the answer is short


# ---- the first trial's size, and the leap -------------------------------------------------

class LazyStateStep:
    """A training-like step: the first call creates ``state`` bytes that stay (like Adam's
    moments) and allocates a one-off ``spike`` on top; every call then needs ``fixed +
    per_sample * b`` bytes while it runs."""

    def __init__(self, state, fixed, per_sample, spike=0):
        self.state_bytes, self.fixed, self.per_sample, self.spike = state, fixed, per_sample, spike
        self.state = None
        self.calls: list[int] = []

    def __call__(self, batch_size: int) -> None:
        import torch

        self.calls.append(batch_size)
        first = self.state is None
        if first:
            self.state = torch.empty(self.state_bytes, dtype=torch.uint8)
        block = torch.empty(int(self.fixed + self.per_sample * batch_size + (self.spike if first else 0)), dtype=torch.uint8)
        del block


def test_trial_records_its_last_step_alone():
    from autobatch.memory.devices import SimulatedDeviceMemory
    from autobatch.probe.trial import TrialRunner

    step = LazyStateStep(state=3 * MiB, fixed=MiB, per_sample=1000, spike=5 * MiB)
    with simulated_memory("64MiB") as device:
        runner = TrialRunner(step, SimulatedDeviceMemory(device), steps=3)
        assert runner(10)
    record = runner.records[0]
    assert record.resident_bytes == 3 * MiB  # the state the first step created
    assert record.step_peak_bytes == 3 * MiB + MiB + 10_000  # the last step: no spike
    assert record.peak_bytes == 3 * MiB + MiB + 10_000 + 5 * MiB  # the trial: the first step's spike
    assert runner.peak_of(10) == record.step_peak_bytes  # what a fit uses


def test_leap_size_is_a_fraction_of_what_one_trial_guarantees():
    from autobatch.probe.searching.predict import LEAP_FRACTION, leap_size

    # resident 100, the step peaked at 300 with 8 samples: 200 per 8 samples at most
    assert leap_size(8, 300, 100, 10_100) == math.floor(8 * 10_000 / 200 * LEAP_FRACTION)
    assert leap_size(8, 300, None, 10_100) is None  # resident memory unknown
    assert leap_size(8, 100, 100, 10_100) is None  # the step added nothing: no growth to scale
    assert leap_size(8, 300, 100, 250) is None  # the trial already used more than the room


@pytest.mark.parametrize("budget", ["64MiB", "1GiB"])
def test_leap_makes_the_second_trial_land_near_the_boundary(budget):
    """A ResNet-like curve (resident state created by the first step, a fixed cost of two
    samples): the second trial leaps past the ladder's 64 to below the boundary, and the
    jump lands on it. The first trial runs 3 steps, so its last step sees the state."""
    def step():
        return LazyStateStep(state=8 * MiB, fixed=80_000, per_sample=40_000)

    with simulated_memory(budget):
        binary = find_max_batch(step(), strategy="binary", steps_per_trial=3)
        result = find_max_batch(step(), strategy="auto", steps_per_trial=3)
    assert result.batch_size == binary.batch_size and result.smallest_failed == result.batch_size + 1
    first, leap = result.trials[0], result.trials[1]
    assert first.batch_size == 8 and first.resident_bytes == 8 * MiB
    assert leap.passed and 64 < leap.batch_size < result.batch_size
    # 8, the leap, one OOM just above the line's boundary, the boundary's full trial
    assert [(t.passed, t.steps) for t in result.trials] == [(True, 3), (True, 1), (False, 1), (True, 3)]


def test_a_leap_that_runs_out_of_memory_leaves_the_ladder_below_it():
    """A cliff the first trial cannot see: the leap fails, the search still ends exact."""
    curve = lambda b: 2 * MiB + 1000 * b + (30 * MiB if b > 100 else 0)  # noqa: E731
    with simulated_memory("24MiB"):
        binary = find_max_batch(MemoryCurveStep(curve), strategy="binary", steps_per_trial=1)
        result = find_max_batch(MemoryCurveStep(curve), strategy="auto", steps_per_trial=1)
    assert result.batch_size == binary.batch_size == 100
    assert result.num_trials < binary.num_trials
    leap = result.trials[2]
    assert leap.purpose == "fit" and not leap.passed and leap.batch_size > 8 * result.trials[1].batch_size
    assert result.fallback_reason is None


@pytest.mark.parametrize("multiple_of, max_batch, first", [(1, None, 8), (3, None, 6), (16, None, 16), (1, 5, 5)])
def test_predict_starts_at_eight_samples(multiple_of, max_batch, first):
    with simulated_memory("24MiB"):
        step = MemoryCurveStep(CURVES["linear"])
        find_max_batch(step, strategy="auto", multiple_of=multiple_of, max_batch=max_batch, steps_per_trial=1)
        assert step.calls[0] == first
        step = MemoryCurveStep(CURVES["linear"])
        find_max_batch(step, strategy="binary", multiple_of=multiple_of, max_batch=max_batch, steps_per_trial=1)
        assert step.calls[0] == multiple_of  # the other strategies start at one multiple


# ---- the allocator's headroom on accelerators ---------------------------------------------

def test_a_trial_whose_peak_passes_the_limit_fails_and_says_why():
    from autobatch.memory.devices import SimulatedDeviceMemory
    from autobatch.probe.trial import TrialRunner

    step = MemoryCurveStep(CURVES["linear"])
    with simulated_memory("64MiB") as device:
        runner = TrialRunner(step, SimulatedDeviceMemory(device), steps=1, peak_limit=CURVES["linear"](100))
        assert runner(100) and not runner(101)
    failed = runner.records[-1]
    assert failed.peak_bytes == CURVES["linear"](101)  # it ran: too close, not out of memory
    assert failed.error.startswith("too close to the capacity")
    # its step figures stay, so a confirmation can step down by the bytes over
    assert failed.over_bytes == CURVES["linear"](101) - CURVES["linear"](100) and failed.step_peak_bytes is not None


def test_the_peak_limit_is_the_capacity_less_the_headroom_on_accelerators_only():
    from autobatch.memory.devices import SimulatedDeviceMemory
    from autobatch.probe.arguments import ALLOCATOR_HEADROOM
    from autobatch.probe.searching.search import peak_limit as _peak_limit

    with simulated_memory("64MiB") as device:
        assert _peak_limit(SimulatedDeviceMemory(device), 64 * MiB) is None  # no caching allocator
    accelerator = object()  # any memory that is not the simulated device
    assert _peak_limit(accelerator, 1000 * MiB) == 1000 * MiB - int(1000 * MiB * ALLOCATOR_HEADROOM)
    assert _peak_limit(accelerator, None) is None


@pytest.mark.parametrize(
    ("device", "expandable", "capped", "capacity", "headroom"),
    [
        ("cuda", True, True, 8 * 1024 * MiB, 40 * MiB),  # two 20 MiB pages, not 1 % (82 MiB)
        ("cuda", True, True, 2 * 1024 * MiB, int(2 * 1024 * MiB * 0.01)),  # never more than 1 %
        ("cuda", True, False, 8 * 1024 * MiB, int(8 * 1024 * MiB * 0.01)),  # the driver's free memory: 1 %
        ("cuda", False, True, 8 * 1024 * MiB, int(8 * 1024 * MiB * 0.01)),  # fixed segments: 1 %
        ("xpu", True, True, 8 * 1024 * MiB, int(8 * 1024 * MiB * 0.01)),  # the setting is CUDA's
    ],
)
def test_expandable_segments_under_a_cap_leave_two_pages_of_headroom_not_a_percent(
    monkeypatch, device, expandable, capped, capacity, headroom
):
    """With expandable segments the caching allocator remaps free pages where a request fits,
    so under a per-process cap (which counts only the allocator's memory) a passing step leaves
    two of its 20 MiB large pages free, not 1 % of the capacity."""
    from types import SimpleNamespace

    import autobatch.memory.allocator as allocator
    from autobatch.probe.searching.search import allocator_headroom, peak_limit as _peak_limit

    monkeypatch.setattr(allocator, "expandable_segments", lambda: expandable)
    memory = SimpleNamespace(device=torch.device(device, 0), cap_binds=lambda: capped)
    assert allocator_headroom(capacity, memory.device, capped=capped) == headroom
    assert _peak_limit(memory, capacity) == capacity - headroom


def test_a_full_trial_whose_steady_steps_leave_no_room_for_split_blocks_fails_at_the_wall():
    """The headroom above the allocated peak is what the steady steps left in split blocks the
    allocator cannot return (measured), and a failed confirmation steps down by the bytes over."""
    from autobatch.memory.devices import SimulatedDeviceMemory
    from autobatch.probe.settling import step_down as _step_down
    from autobatch.probe.trial import TrialRunner

    class Allocator(SimulatedDeviceMemory):
        """A simulated device whose split-block figure is set by the step, as CUDA reports it."""

        split = 0
        reused = False  # the split pieces are blocks the step's own activations filled at its peak

        def inactive_split(self) -> int:
            return self.split

        flushing = False  # each step makes the allocator return its cache to serve a request
        retries = 0

        def peak_reserved(self) -> int:
            return self.peak() + (0 if self.reused else self.split)

        def alloc_retries(self) -> int:
            return self.retries

    capacity = 64 * MiB
    with simulated_memory(capacity) as device:
        memory = Allocator(device)

        def step(batch_size: int) -> None:
            held = torch.empty(batch_size * 8 * MiB, dtype=torch.uint8)  # 4 -> 32 MiB, far under 0.99 x 64
            memory.split = 40 * MiB if batch_size >= 3 else 0  # 3 x 8 + 40 + 2 = 66 > 64
            memory.retries += memory.flushing
            del held

        runner = TrialRunner(step, memory, steps=3, peak_limit=int(capacity * 0.99))
        assert runner(2)
        assert runner.run(3, steps=1).passed  # one step says nothing of the steady state
        assert not runner(4)
    failed = runner.records[-1]
    assert failed.error.startswith("at the allocator's wall: allocated peak 32.00 MiB plus 40.00 MiB left in split blocks")
    assert failed.over_bytes == 32 * MiB + 40 * MiB + 2 * MiB - capacity  # 10 MiB over
    assert runner.records[0].inactive_split_bytes == 0
    # the confirmation steps down by the bytes over, not a percent: 32 MiB / 4 = 8 per unit
    assert _step_down(failed, 4) == 2  # ceil(10 / 8)
    # the same pieces, filled by the step's activations at its peak (its reserved memory stayed
    # clear of the capacity and no step flushed the cache): no wall
    with simulated_memory(capacity) as device:
        memory = Allocator(device)
        memory.reused = True
        assert TrialRunner(step, memory, steps=3, peak_limit=int(capacity * 0.99)).run(4).passed
        # steps that flush the cache returned blocks, so the reserved peak no longer holds every piece
        memory.flushing = True
        assert not TrialRunner(step, memory, steps=3, peak_limit=int(capacity * 0.99)).run(4).passed


def test_a_trial_above_the_headroom_says_by_how_much():
    from autobatch.probe.settling import step_down as _step_down
    from autobatch.probe.trial import TrialRunner

    capacity = 64 * MiB
    with simulated_memory(capacity) as device:
        from autobatch.memory.devices import SimulatedDeviceMemory

        def step(batch_size: int) -> None:
            held = torch.empty(batch_size * 4 * MiB, dtype=torch.uint8)
            del held

        runner = TrialRunner(step, SimulatedDeviceMemory(device), steps=3, peak_limit=30 * MiB)
        assert runner(10) is False  # 40 MiB allocated: 10 above the limit
    failed = runner.records[-1]
    assert failed.steps == 1  # stopped at the first step above the limit: more could not pass
    with simulated_memory(capacity) as device:  # ranks in lockstep (an agreement) run every step
        agreed = TrialRunner(step, SimulatedDeviceMemory(device), steps=3, peak_limit=30 * MiB, agree=lambda r: r)
        assert agreed(10) is False and agreed.records[-1].steps == 3
    assert failed.error.startswith("too close to the capacity") and failed.over_bytes == 10 * MiB
    assert _step_down(failed, 10) == 3  # ceil(10 MiB / 4 MiB per sample), not a percent


@pytest.mark.parametrize("curve", ["linear", "rounded-blocks", "sqrt-then-linear"])
def test_under_a_peak_limit_every_strategy_stops_at_it(curve):
    """predict aims its line at the limit, so it lands where binary does, in fewer trials."""
    from autobatch.memory.devices import SimulatedDeviceMemory
    from autobatch.probe.searching.search import run_search as _search
    from autobatch.probe.trial import TrialRunner

    limit = 20 * MiB
    results = {}
    for strategy in ("binary", "auto"):
        with simulated_memory("24MiB") as device:
            memory = SimulatedDeviceMemory(device)
            runner = TrialRunner(MemoryCurveStep(CURVES[curve]), memory, steps=1, peak_limit=limit)
            results[strategy] = _search(
                runner, strategy=strategy, start=None, max_batch=None, margin=0.0, multiple_of=1,
                device_name=memory.name, capacity=24 * MiB,
            )
    found = results["binary"].batch_size
    assert results["auto"].batch_size == found
    assert CURVES[curve](found) <= limit < CURVES[curve](found + 1)
    assert results["auto"].num_trials < results["binary"].num_trials


def test_a_refuted_line_steps_down_by_the_failed_sizes_shortfall(monkeypatch):
    """A memory curve that bends up near the capacity: the line from two passing trials says
    247 fits; 247 runs out of memory, and what it had allocated plus the allocation that failed
    (its ``over_bytes``) is worth ~11 samples at the line's slope, so the next trial is at the
    bracket's midpoint, not a 0.5 % stride down. Same answer, no more trials than without."""
    from autobatch import find_max_batch, simulated_memory
    from autobatch.probe.trial import TrialRunner

    def step(batch_size: int) -> None:
        linear = torch.empty(batch_size * 2**16, dtype=torch.uint8)
        bend = torch.empty(max(0, batch_size - 200) ** 2 * 600, dtype=torch.uint8)
        del linear, bend

    with simulated_memory("16MiB"):
        informed = find_max_batch(step, steps_per_trial=1)
    refuted = next(t for t in informed.trials if not t.passed and t.purpose == "verify")
    assert refuted.over_bytes and refuted.over_bytes > 10 * 2**16
    monkeypatch.setattr(TrialRunner, "short_of", lambda self, batch_size: None)
    with simulated_memory("16MiB"):
        blind = find_max_batch(step, steps_per_trial=1)
    assert informed.batch_size == blind.batch_size == 240
    sizes = [t.batch_size for t in informed.trials]
    after = sizes[sizes.index(refuted.batch_size) + 1]
    assert refuted.batch_size - after >= 5  # the shortfall's stride (the midpoint), not one sample
    blind_sizes = [t.batch_size for t in blind.trials]
    assert refuted.batch_size - blind_sizes[blind_sizes.index(refuted.batch_size) + 1] == 1
    assert len(informed.trials) <= len(blind.trials)


def test_an_oom_at_the_allocators_wall_aims_the_line_below_the_free_pieces(monkeypatch):
    """ViT-B/16 on an H200 (issue 16): the allocated line was right, but sizes above the answer
    failed with a fifth of a GiB free in pieces too small for the failed allocation. The failed
    trial's reserved peak less its allocated peak (``wall_bytes``) aims the line below those
    pieces: the same answer in fewer trials than galloping down from the refuted line."""
    from autobatch.memory.devices import SimulatedDeviceMemory
    from autobatch.probe.searching.search import peak_limit, run_search
    from autobatch.probe.trial import TrialRunner

    capacity, per_sample, fixed, pieces = 64 * MiB, 2**19, 8 * MiB, 3 * MiB  # pieces: ~5 % of the capacity

    class Allocator(SimulatedDeviceMemory):
        """Reserves its allocated peak plus free pieces; a step needing more than that fails."""

        def peak_reserved(self) -> int:
            return min(capacity, self.peak() + pieces)

    def step(batch_size: int) -> None:
        activations = torch.empty(fixed + batch_size * per_sample * 3 // 4, dtype=torch.uint8)
        last = batch_size * per_sample // 4  # e.g. backward's largest gradient
        if activations.numel() + last + pieces > capacity:  # the last request finds no piece large enough
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {last / MiB:.2f} MiB.")
        grads = torch.empty(last, dtype=torch.uint8)
        del activations, grads

    def probe():
        with simulated_memory(capacity) as device:
            memory = Allocator(device)
            runner = TrialRunner(step, memory, steps=1, peak_limit=peak_limit(object(), capacity))
            return run_search(runner, strategy="predict", start=None, max_batch=None, margin=0.0,
                              multiple_of=1, device_name=memory.name, capacity=capacity), runner

    informed, runner = probe()
    exact = (capacity - pieces - fixed) // per_sample
    assert informed.batch_size == exact
    walls = [record.wall_bytes for record in runner.records if not record.passed]
    assert walls and all(wall == pieces for wall in walls)
    assert informed.fit["aimed_at_wall_bytes"] == capacity - pieces
    monkeypatch.setattr(TrialRunner, "wall_of", lambda self, batch_size: None)
    blind, _ = probe()
    assert blind.batch_size == exact
    assert len(informed.trials) < len(blind.trials)


def _adamw_mlp_predict_and_binary(width: int):
    """An MLP (256 -> ``width`` -> 10) with AdamW under a 32 MiB budget, probed by ``predict``
    and by ``binary``: at small sizes AdamW's step makes the peak, so the peaks are flat, then rise."""
    step = make_mlp_step(width=width, depth=1, in_features=256, optimizer="adamw")
    found = {}
    for strategy in ("predict", "binary"):
        with simulated_memory("32MiB"):
            found[strategy] = find_max_batch(step, strategy=strategy, cache=False)
    return found["predict"], found["binary"]


def test_a_line_from_a_flat_stretch_grows_by_one_more_leap_before_it_jumps():
    """At small sizes the optimizer step's temporaries make the peak (flat), so a line from the
    end of that flat stretch (a corner) is too shallow and overshoots by a third. The fit grows
    by one more leap instead of jumping from the corner: the binary answer in 6 trials, where
    jumping and then bisecting the bracket took 17."""
    predicted, binary = _adamw_mlp_predict_and_binary(1024)
    assert predicted.batch_size == binary.batch_size
    assert predicted.fit["measured"][1][1] == predicted.fit["measured"][0][1]  # the flat stretch
    assert len(predicted.trials) <= 6


def test_a_failure_before_any_growing_line_bisects_until_one_exists_then_follows_it():
    """A wide MLP whose peak is AdamW's step up to a few hundred samples: the ×8 ladder's first
    OOM comes before any growing line. The bracket is bisected until a passing size gives one,
    and that line is followed: the binary answer in fewer trials than binary, as predict."""
    predicted, binary = _adamw_mlp_predict_and_binary(4096)
    assert predicted.batch_size == binary.batch_size
    assert predicted.strategy_used == "predict" and predicted.fallback_reason is None
    assert len(predicted.trials) < len(binary.trials) - 5


def test_galloping_down_from_the_wall_lands_on_the_answer_without_a_pass_below_it():
    """The trials of a ViT-B/16 ``TrainStep`` probe on an H200 (8 GiB cap, issue 16), replayed:
    after the line's jump, 105, 103, 102 and 101 ran out of memory at the allocator's wall and
    100 trains. The gallop's strides are fractions of the batch (0.5 %, 1 %: one sample each at
    this size) and the wall failures' shortfalls are the allocator's estimates, not lower
    bounds, so they do not lengthen a stride: the search steps 101 -> 100, where strides of a
    doubled count (1, 2) or the estimate (112 MiB: two samples) went to 99, a passing trial below
    the answer, and then to 100, a second one."""
    from autobatch.probe.searching.predict import predictive

    mib = 2**20
    capacity = 8 * 2**30
    passing = {8: 1763.5, 71: 5922.0}  # allocated peaks of the steady steps, MiB
    resident = {8: 1050.0}  # allocated as the last step began (weights, AdamW state), MiB
    walls = {105: 185.3, 103: 150.8, 102: 203.8, 101: 324.8}  # free pieces at the failure, MiB
    tried = []

    def passes(units, purpose="search"):
        tried.append(units)
        return units <= 100

    def peak_of(units):
        return int(passing.get(units, 1235.4 + 66.01 * units) * mib)

    outcome = predictive(
        passes, peak_of, 8, 2**24, int(capacity * 0.99), above_first=True,
        resident_of=lambda units: int(resident[units] * mib) if units in resident else None,
        short_of=lambda units: None,  # TrialRunner.short_of: no lower bound at the wall
        usable_after=lambda units: capacity - int(walls[units] * mib) if units in walls else None,
    )
    assert outcome.units == 100
    assert tried[:2] == [8, 71]  # the leap from 8 lands where the recorded probe's did
    assert tried[2:] == [105, 103, 102, 101, 100]
    assert all(size >= 100 for size in tried[2:])  # no passing trial below the answer


def test_below_a_wall_a_size_that_passes_one_step_but_not_two_is_found_by_running_every_step():
    """The trials of a ViT-B/16 plain-callable probe on an H200 (8 GiB cap, issue 16), replayed:
    104 ran out of memory at the allocator's wall; 100, just above the wall-lowered line, passed
    one step and failed the second (the free pieces split by the first). Run as a one-step search
    it passed, so the search went on to 101 (an OOM) and a full confirmation of 100 that failed,
    then 99. Below a wall the search runs every step of its trials (``purpose="wall"``): 100 fails
    as a whole, and 99's trial is the answer's own full pass."""
    from autobatch.probe.searching.predict import predictive

    mib = 2**20
    capacity = 8 * 2**30
    passing = {8: 1771.2, 70: 5879.1, 99: 7837.9}  # allocated peaks of the steady steps, MiB
    walls = {104: 374.7, 100: 275.2, 101: 222.9}  # free pieces at the failure, MiB
    tried = []

    def passes(units, purpose="search"):
        tried.append((units, purpose))
        return units <= 99 or (units == 100 and purpose != "wall")  # 100 fails at its second step

    outcome = predictive(
        passes, lambda units: int(passing.get(units, 1241.2 + 66.26 * units) * mib), 8, 2**24,
        int(capacity * 0.99), above_first=True,
        resident_of=lambda units: int(1049.3 * mib) if units == 8 else None,
        short_of=lambda units: None,
        usable_after=lambda units: capacity - int(walls[units] * mib) if units in walls else None,
    )
    assert outcome.units == 99
    assert [units for units, _ in tried[:2]] == [8, 70]  # the recorded probe's fit
    assert tried[2:] == [(104, "verify"), (100, "wall"), (99, "wall")]


def test_trials_below_a_wall_run_every_step_and_the_last_one_is_the_answers_confirmation():
    """Through ``run_search``: after a failure at the allocator's wall, the trials that follow
    the lowered line call the step ``steps_per_trial`` times (a one-step search trial elsewhere),
    so the passing one confirms the answer and no separate confirmation runs."""
    from autobatch.memory.devices import SimulatedDeviceMemory
    from autobatch.probe.searching.search import peak_limit, run_search
    from autobatch.probe.trial import TrialRunner

    capacity, per_sample, fixed, pieces = 64 * MiB, 2**19, 8 * MiB, 3 * MiB

    class Allocator(SimulatedDeviceMemory):
        def peak_reserved(self) -> int:
            return min(capacity, self.peak() + pieces)

    def step(batch_size: int) -> None:
        activations = torch.empty(fixed + batch_size * per_sample * 3 // 4, dtype=torch.uint8)
        last = batch_size * per_sample // 4
        if activations.numel() + last + pieces > capacity:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {last / MiB:.2f} MiB.")
        grads = torch.empty(last, dtype=torch.uint8)
        del activations, grads

    with simulated_memory(capacity) as device:
        memory = Allocator(device)
        runner = TrialRunner(step, memory, steps=3, search_steps=1, peak_limit=peak_limit(object(), capacity))
        result = run_search(runner, strategy="predict", start=None, max_batch=None, margin=0.0,
                            multiple_of=1, device_name=memory.name, capacity=capacity)
    assert result.batch_size == (capacity - pieces - fixed) // per_sample
    below_wall = [record for record in runner.records if record.purpose == "wall"]
    assert below_wall and all(record.steps == 3 for record in below_wall if record.passed)
    assert runner.records[-1].purpose == "wall" and runner.records[-1].passed  # no "confirm" trial after it
    assert runner.records[-1].batch_size == result.batch_size


def test_a_failure_at_the_wall_gives_no_lower_bound_of_its_shortfall():
    """``TrialRunner.short_of`` hands the search a failed size's shortfall only where it is a lower
    bound (what was allocated plus the allocation that failed passed the limit), not the
    allocator's estimate from its reserved memory (a failure at its wall)."""
    from autobatch.probe.records import TrialRecord
    from autobatch.probe.trial import TrialRunner

    runner = TrialRunner(lambda batch: None, memory=None, steps=1)
    runner.records = [
        TrialRecord(101, False, 7_861 * 2**20, 0.07, over_bytes=112 * 2**20, wall_bytes=325 * 2**20),
        TrialRecord(90, False, 7_990 * 2**20, 0.07, over_bytes=40 * 2**20),
    ]
    assert runner.short_of(101) is None
    assert runner.short_of(90) == 40 * 2**20
    assert runner.short_of(50) is None  # never failed


# ---- the line settles the last step (accelerators) -------------------------------------------

RESNET_LIMIT = int(8 * 2**30 * 0.99)  # an H200 capped at 8 GiB, less the allocator's headroom


def _replay(passing: dict, resident8: int, secant: tuple, settle: bool = True):
    """``predictive`` over a ResNet-50 probe's H200 figures (issue 16): the measured allocated
    peaks of the passing trials, and beyond them the line through the two largest."""
    from autobatch.probe.searching.predict import predictive

    (u0, p0), (u1, p1) = secant
    slope = (p1 - p0) / (u1 - u0)

    def peak_of(units):
        return passing.get(units, int(p1 + slope * (units - u1)))

    tried = []

    def passes(units, purpose="search"):
        tried.append((units, purpose))
        return peak_of(units) <= RESNET_LIMIT

    outcome = predictive(
        passes, peak_of, 8, 2**24, RESNET_LIMIT, above_first=True,
        resident_of=lambda units: resident8 if units == 8 else None,
        short_of=lambda units: peak_of(units) - RESNET_LIMIT if peak_of(units) > RESNET_LIMIT else None,
        settle=settle,
    )
    return outcome, tried


def test_the_line_settles_the_last_step_where_it_puts_the_next_size_well_past_the_limit():
    """ResNet-50 as a plain callable on an H200: the leap's line put 181 0.56 of a sample past
    the limit, so the jump tried 180 first as a full trial (``edge``); the line refitted through
    it put 181 0.41 of a sample past, so 181 (an OOM trial above-first) is not run."""
    passing = {8: 791_321_088, 134: 6_427_004_416, 180: 8_477_687_296}
    outcome, tried = _replay(passing, 353_400_000, ((134, passing[134]), (180, passing[180])))
    assert tried == [(8, "fit"), (134, "fit"), (180, "edge")]
    assert outcome.units == 180
    assert 0.25 * 44e6 < outcome.settled < 0.5 * 45e6  # bytes past the limit, about 0.41 of a sample
    assert outcome.fit_record(1)["settled_above"] == {"batch_size": 181, "past_limit_bytes": outcome.settled}
    # without settling: above-first, as before (181 runs out of memory, then 180 in full)
    outcome, tried = _replay(passing, 353_400_000, ((134, passing[134]), (180, passing[180])), settle=False)
    assert [units for units, _ in tried] == [8, 134, 181, 180] and outcome.settled is None


def test_a_boundary_tried_first_that_fails_is_followed_by_the_size_below_it_in_full():
    """ResNet-50 as a ``TrainStep`` on an H200: the leap's line said 182 fits with 9 MiB to
    spare; it came 4.8 MiB over. Above-first went 183 (OOM) → 182 (over) → 181; trying the
    boundary first skips 183, and 181's trial is full, the answer's own confirmation."""
    passing = {8: 787_552_256, 136: 6_456_965_632, 181: 8_474_575_872}
    outcome, tried = _replay(passing, 357_309_440, ((136, passing[136]), (181, passing[181])))
    assert tried == [(8, "fit"), (136, "fit"), (182, "edge"), (181, "verify")]
    assert outcome.units == 181 and outcome.settled is None  # 182 failed: closed by trials


def test_the_line_settles_nothing_closer_than_twice_what_the_followed_line_missed_by():
    """A small CNN's probe on an H200 (2 GiB cap), replayed: its peaks climb in uneven stairs
    (+3.2 and +9.4 MB by turns), and 324's peak moved 2.4 MB between processes, either side of
    the limit. The leap's line missed 323's peak by 2.0 MB and the refit put 324 2.1 MB past
    the limit (a third of a sample): too close to settle, so 324 is tried."""
    from autobatch.probe.searching.predict import predictive

    limit = int(2 * 2**30 * 0.99)
    measured = {8: 121_734_144, 279: 1_844_151_296, 323: 2_121_760_768, 324: 2_126_218_240}
    tried = []

    def passes(units, purpose="search"):
        tried.append((units, purpose))
        return measured.get(units, units * 7_000_000) <= limit

    outcome = predictive(passes, measured.get, 8, 2**24, limit, above_first=True,
                         resident_of=lambda units: 68_800_000 if units == 8 else None, settle=True)
    assert tried == [(8, "fit"), (279, "fit"), (323, "edge"), (324, "verify")]
    assert outcome.units == 323 and outcome.settled is None


def test_the_line_settles_nothing_under_a_hundred_units_or_where_it_bends():
    """One unit short is more than 1 % below a hundred units, and a refit that bends away from
    the line it followed (a kernel switch, a rounding step) is no prediction: the size above runs."""
    from autobatch.probe.searching.predict import predictive

    def search(curve, limit):
        tried = []

        def passes(units, purpose="search"):
            tried.append(units)
            return curve(units) <= limit

        outcome = predictive(passes, curve, 8, 2**24, limit, above_first=True,
                             resident_of=lambda units: 3 * MiB if units == 8 else None, settle=True)
        return outcome, tried

    linear = lambda units: 4 * MiB + units * 8 * MiB  # noqa: E731
    outcome, tried = search(linear, linear(50) + 4 * MiB)  # answer 50: above-first, 51 runs
    assert outcome.units == 50 and 51 in tried and outcome.settled is None
    outcome, tried = search(linear, linear(150) + 4 * MiB)  # answer 150: settled by the line
    assert outcome.units == 150 and 151 not in tried and outcome.settled == 4 * MiB
    # a step of 10 % in the slope past 120 units: the refit bends, so 151 is tried
    bent = lambda units: linear(units) + (0.8 * MiB * (units - 120) if units > 120 else 0)  # noqa: E731
    outcome, tried = search(bent, int(bent(150) + 4 * MiB))
    assert outcome.units == 150 and 151 in tried and outcome.settled is None
    # three quarters of a unit past, but a unit is 2 MiB: within the allocator's stairs, so the
    # line can settle nothing, and the search stays above-first (151, then 150)
    small = lambda units: 4 * MiB + units * 2 * MiB  # noqa: E731
    outcome, tried = search(small, small(150) + MiB // 2)
    assert outcome.units == 150 and tried[-2:] == [151, 150] and outcome.settled is None


def test_a_settled_answer_says_so_and_needs_no_separate_confirmation():
    """Through ``run_search`` with an accelerator's peak limit: the boundary's full trial is the
    answer's confirmation, the size above it is not run, and the result says why."""
    from autobatch.memory.devices import SimulatedDeviceMemory
    from autobatch.probe.searching.search import peak_limit, run_search
    from autobatch.probe.trial import TrialRunner

    capacity, per_sample = 2**30, 4 * MiB  # the next size lands 2.24 MiB past the limit

    def step(batch_size: int) -> None:
        held = torch.empty(8 * MiB + batch_size * per_sample, dtype=torch.uint8)
        del held

    with simulated_memory(capacity) as device:
        memory = SimulatedDeviceMemory(device)
        limit = peak_limit(object(), capacity)
        runner = TrialRunner(step, memory, steps=3, search_steps=1, peak_limit=limit)
        result = run_search(runner, strategy="predict", start=None, max_batch=None, margin=0.0,
                            multiple_of=1, device_name=memory.name, capacity=capacity)
    exact = (limit - 8 * MiB) // per_sample
    assert result.batch_size == exact
    assert exact + 1 not in [record.batch_size for record in runner.records]
    last = runner.records[-1]
    assert last.batch_size == exact and last.purpose == "edge" and last.steps == 3 and last.passed
    assert any(note.startswith(f"{exact + 1} was not tried: the memory line") for note in result.notes)
    assert result.fit["settled_above"]["batch_size"] == exact + 1


def test_a_line_past_what_its_largest_pass_guarantees_grows_by_one_more_leap():
    """The trials of a ViT-B/32 probe (plain callable) on an H200 (8 GiB cap), replayed: at 8
    the peak is AdamW's step (flat), so the line through 8 and the leap's 74 rose 12.6 MiB a
    sample where the curve rises 17.5 and said 513. What 74's own step guarantees (everything
    above its resident memory counted as growing with the batch) is 343: a straight line cannot
    say more than that by half. The search leaps once more, from 74, before it jumps: the
    boundary in two trials after it, where jumping to 513 took seven failures at the wall and a
    bisection of 74-489 (20 trials in all)."""
    from autobatch.probe.searching.predict import LEAP_FRACTION, predictive

    mib = 2**20
    capacity = 8 * 2**30
    usable = int(capacity * 0.99)
    resident = 1058.0 * mib  # weights and AdamW state, as the leap from 8 to 74 implies

    def peak_of(units):
        return int((1744.0 if units == 8 else 1280.5 + 17.49 * units) * mib)

    tried = []

    def passes(units, purpose="search"):
        tried.append(units)
        return peak_of(units) <= usable  # 390 (the wall the real trials met is tested above)

    outcome = predictive(passes, peak_of, 8, 2**24, usable, above_first=True,
                         resident_of=lambda units: int(resident), short_of=lambda units: None)
    assert outcome.units == 390
    second_leap = math.floor(74 * (usable - resident) / (peak_of(74) - resident) * LEAP_FRACTION)
    assert tried == [8, 74, second_leap, 391, 390]  # the jump: above the boundary first, then it


def test_a_line_that_agrees_with_what_its_pass_guarantees_jumps_at_once():
    """ResNet-50 on an H200 (8 GiB cap): the line through 8 and the leap's 134 and what 134
    guarantees agree (182 and 180), so the search jumps from the two points, as before."""
    from autobatch.probe.searching.predict import predictive

    mib = 2**20
    usable = int(8 * 2**30 * 0.99)
    tried = []

    def passes(units, purpose="search"):
        tried.append(units)
        return units <= 181

    def peak_of(units):
        return int((751.1 if units == 8 else 409.0 + 42.69 * units) * mib)

    outcome = predictive(passes, peak_of, 8, 2**24, usable, above_first=True,
                         resident_of=lambda units: 333 * mib, short_of=lambda units: None)
    assert outcome.units == 181
    assert tried[1] in (133, 134) and all(size > 134 for size in tried[2:])


@pytest.mark.parametrize("budget, trials_before", [("40MiB", 11), ("80MiB", 12)])
def test_a_transformer_under_adamw_leaps_past_its_optimizer_plateau_and_lands_exact(budget, trials_before):
    """A small transformer encoder under AdamW as a plain callable (simulated device): at 8 the
    peak is the optimizer step's, so the line through 8 and 64 overshot by 9-12 % and the
    search galloped down four failures before bisecting (``trials_before``). What 64 guarantees
    says the line is too shallow; one more leap lands below the boundary and the jump hits it:
    the binary answer in six trials."""
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(16, 128), nn.TransformerEncoder(
        nn.TransformerEncoderLayer(128, 4, 512, batch_first=True, dropout=0.0), 4), nn.Flatten(), nn.Linear(1024, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(size):
        optimizer.zero_grad(set_to_none=True)
        inputs, targets = torch.randn(size, 8, 16), torch.randint(0, 10, (size,))
        nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()

    with simulated_memory(budget):
        result = find_max_batch(step, cache=False)
    assert result.num_trials == 6 < trials_before
    assert result.smallest_failed == result.batch_size + 1  # exact: the size above failed
    leap = result.trials[3]
    assert leap.purpose == "fit" and leap.passed and result.trials[2].batch_size < leap.batch_size < result.batch_size


def test_review38_a_failed_first_trial_steps_down_by_a_quarter_at_a_few_samples():
    """At 8 units or fewer a failed first trial steps down by a quarter, not half: a halving's pass
    lands up to half the boundary below it and bisecting back up runs another pass, each a new
    size's full step (a SegFormer under 8 GiB, boundary 6: 4 then 6 passed, 3.3-3.9 s each). Above
    it a start set high still halves."""
    def search(boundary: int, first: int) -> tuple[int | None, list[int]]:
        tried: list[int] = []

        def passes(units: int, purpose: str = "") -> bool:
            tried.append(units)
            return units <= boundary

        outcome = predictive(passes, lambda units: 1000 + 100 * units, first, 10**6, 1000 + 100 * boundary + 50)
        return outcome.units, tried

    assert search(6, 8) == (6, [8, 6, 7])  # halving: 8, 4, 6, 7
    assert search(3, 8) == (3, [8, 6, 4, 3])  # halving: 8, 4, 2, 3 (two passes)
    assert search(1, 8) == (1, [8, 6, 4, 3, 2, 1])
    assert search(20, 64) == (20, [64, 32, 16, 24, 20, 21])  # above 8 units, halving as before
