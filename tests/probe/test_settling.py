"""The answer's trial settles (issue 16): cuDNN's plan cache is left to training, and with
autotuning a size whose steps still flush the allocator's cache is not an answer.

On the CPU the allocator's retry counter is played by a fake memory whose counter the step
advances; the cuDNN flags are plain flags without a GPU, so the autotune switching is checked
exactly as it runs on one."""

import pytest
import torch

from autobatch import TrainStep, find_max_batch, simulated_memory
from autobatch.memory.devices import SimulatedDeviceMemory
from autobatch.probe.autotune import Autotune
from autobatch.probe.searching.search import _confirm
from autobatch.probe.settling import FlushCount, wall_excess
from autobatch.probe.trial import TrialRunner

MiB = 2**20


@pytest.fixture
def cudnn_flags():
    """Put the process's cuDNN flags back after a test sets them."""
    saved = torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic
    yield
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved


@pytest.mark.parametrize("deterministic", [False, True])
def test_untuned_trials_cache_their_plans_under_a_key_training_never_uses(cudnn_flags, deterministic):
    """PyTorch keys cuDNN's plan cache by ``deterministic`` but not by ``benchmark``: an untuned
    trial runs with ``deterministic`` flipped, so its heuristic plans never stand in for the
    autotuned ones training would pick; a tuned trial runs under the user's own flags."""
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = True, deterministic
    autotune = Autotune(torch.device("cuda"))
    assert autotune.wanted
    with autotune.trial(tuned=False):
        assert torch.backends.cudnn.benchmark is False
        assert torch.backends.cudnn.deterministic is (not deterministic)
    assert (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic) == (True, deterministic)
    with autotune.trial(tuned=True):
        assert (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic) == (True, deterministic)
    with pytest.raises(RuntimeError), autotune.trial(tuned=False):
        raise RuntimeError("a trial's own error")
    assert (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic) == (True, deterministic)


def test_without_autotuning_the_flags_are_left_alone(cudnn_flags):
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, False
    for device in (torch.device("cuda"), torch.device("cpu")):
        with Autotune(device).trial(tuned=False):
            assert (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic) == (False, False)
    torch.backends.cudnn.benchmark = True
    with Autotune(torch.device("cpu")).trial(tuned=False):  # nothing to tune off CUDA
        assert (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic) == (True, False)


def test_flush_count_ignores_the_first_step():
    count = FlushCount()
    assert count.flushes is None and not count.flushing  # nothing read: a device that does not count
    for retries in (0, 3, 3, 4):  # before the first step, then after each of three
        count.read(retries)
    assert count.flushes == 1 and count.flushing  # step 1's three retries are the autotuner's
    count.read(4)
    assert count.flushes == 1 and not count.flushing
    count.read(None)  # an unreadable counter changes nothing
    assert count.flushes == 1


def test_wall_excess_leaves_room_for_a_request():
    assert wall_excess(100 * MiB, 10 * MiB, 200 * MiB) == 0
    assert wall_excess(190 * MiB, 9 * MiB, 200 * MiB) == MiB


def test_a_step_whose_reserved_memory_stayed_clear_of_the_capacity_never_met_the_wall():
    """Pieces split at the end of a step may be the blocks its activations filled at the peak
    (optimizer state created mid-step): the step's own reserved peak bounds them."""
    assert wall_excess(150 * MiB, 60 * MiB, 200 * MiB, reserved_peak=180 * MiB) == 0
    assert wall_excess(150 * MiB, 60 * MiB, 200 * MiB, reserved_peak=199 * MiB) == MiB  # the reserved figure, smaller
    assert wall_excess(190 * MiB, 9 * MiB, 200 * MiB, reserved_peak=200 * MiB) == MiB  # the pieces' figure, smaller


class FlushingMemory(SimulatedDeviceMemory):
    """The simulated device with an allocator retry counter, advanced by the step."""

    def __init__(self, simulation) -> None:
        super().__init__(simulation)
        self.retries = 0

    def alloc_retries(self) -> int:
        return self.retries


def flushing_step(memory: FlushingMemory, from_size: int, steady_from: int | None = None):
    """A step that makes the allocator flush at every call at ``from_size`` and above (at the
    first call of a trial too, as autotuning does); with ``steady_from``, only before that call."""
    calls = {}

    def step(batch_size: int) -> None:
        calls[batch_size] = calls.get(batch_size, 0) + 1
        torch.empty(batch_size * 1000, dtype=torch.uint8)
        if batch_size >= from_size and (steady_from is None or calls[batch_size] < steady_from):
            memory.retries += 2

    return step


def settling_runner(memory: FlushingMemory, step) -> TrialRunner:
    """A runner as on an accelerator (a peak limit, answers that settle) with autotuning as the
    process's flag says."""
    return TrialRunner(step, memory, steps=3, peak_limit=60 * MiB, autotune=Autotune(torch.device("cuda")),
                       settle_final=True)


@pytest.mark.parametrize("wanted", [True, False])
@pytest.mark.parametrize("purpose", ["confirm", "verify"])
def test_with_autotuning_a_settle_trial_fails_while_its_steps_still_flush(cudnn_flags, wanted, purpose):
    torch.backends.cudnn.benchmark = wanted
    with simulated_memory("64MiB") as device:
        memory = FlushingMemory(device)
        runner = settling_runner(memory, flushing_step(memory, from_size=50))
        record = runner.run(50, purpose, settle=True)
    assert record.flushes == record.steps - 1  # every step after the first
    # it kept settling and still flushed: at the allocator's wall (a TrainStep's too: ResNet-101's
    # Runner ran out of memory at such an answer in every process)
    assert not record.passed and "return its cache" in record.error
    assert record.autotuned is ((purpose == "confirm") if wanted else None)  # untuned trials count too: a guide
    # up to twice its steps; four times after an autotuning first step, which leaves the
    # allocator further from settled
    assert record.steps == (12 if wanted and purpose == "confirm" else 6)
    assert ("autotuning" in record.error) is wanted and ("replay" in record.error) is not wanted


@pytest.mark.parametrize("expandable", [True, False])
def test_with_expandable_segments_an_untuned_settle_trial_fails_while_its_steps_still_flush(
    cudnn_flags, monkeypatch, expandable
):
    """Expandable segments remap free pages on a flush, so a step that flushes every time is at
    the cap (on an H200 such answers ran out of memory at training steps 10-93): without
    autotuning too, the trial keeps settling and fails if its last step still flushes."""
    import autobatch.memory.allocator as allocator

    torch.backends.cudnn.benchmark = False
    monkeypatch.setattr(allocator, "expandable_segments", lambda: expandable)
    with simulated_memory("64MiB") as device:
        memory = FlushingMemory(device)
        memory.device = torch.device("cuda", 0)  # the setting is CUDA's
        runner = settling_runner(memory, flushing_step(memory, from_size=50))
        flushing = runner.run(50, "verify", settle=True)
        settled = settling_runner(memory, flushing_step(memory, from_size=1, steady_from=4)).run(40, "verify", settle=True)
    assert not flushing.passed and flushing.steps == 6  # fixed segments too (a TrainStep's Runner)
    assert ("expandable segments" in flushing.error) is expandable
    assert settled.passed and settled.steps == 4  # its flushing stopped while it settled


def test_a_trial_whose_flushing_stops_while_it_settles_passes(cudnn_flags):
    torch.backends.cudnn.benchmark = True
    with simulated_memory("64MiB") as device:
        memory = FlushingMemory(device)
        runner = settling_runner(memory, flushing_step(memory, from_size=1, steady_from=4))  # steps 1-3 flush
        record = runner.run(40, "confirm", settle=True)
    assert record.passed and record.steps == 4 and record.flushes == 2


@pytest.mark.parametrize("purpose", ["confirm", "verify"])
def test_a_tuned_confirmation_may_settle_for_longer_than_an_untuned_trial(cudnn_flags, purpose):
    """Flushing that stops at step 8 (after a tuned first step, as on an H200 at sizes that
    train): the tuned confirmation passes at its eighth step; an untuned trial stops at six."""
    torch.backends.cudnn.benchmark = True
    with simulated_memory("64MiB") as device:
        memory = FlushingMemory(device)
        runner = settling_runner(memory, flushing_step(memory, from_size=1, steady_from=8))  # steps 1-7 flush
        record = runner.run(40, purpose, settle=True)
    if purpose == "confirm":
        assert record.passed and record.steps == 8 and record.flushes == 6
    else:
        assert not record.passed and record.steps == 6 and record.flushes == 5


def test_the_confirmation_steps_down_to_a_size_that_stops_flushing(cudnn_flags):
    torch.backends.cudnn.benchmark = True
    with simulated_memory("64MiB") as device:
        memory = FlushingMemory(device)
        runner = settling_runner(memory, flushing_step(memory, from_size=50))
        assert _confirm(runner, 51, 1, after_last_oom=True) == 49
    assert [(r.batch_size, r.passed, r.autotuned) for r in runner.records] == [
        (51, False, True), (50, False, True), (49, True, True)]
    assert torch.backends.cudnn.benchmark is True  # the user's setting, back


def _pinned_runner(device, wall_sizes):
    """A runner over a step that runs out of memory at the allocator's wall (2 MiB asked, far
    under the limit, 8 MiB held in pieces) at ``wall_sizes`` while optimizer state made at
    another size is resident: the Llama-style decoder's trial at 5 beside state made at 4."""
    from autobatch.memory.lazy_state import LazyStateWatch
    from autobatch.probe.pinned_state import PinnedState

    class Fragmented(SimulatedDeviceMemory):
        def peak_reserved(self) -> int:
            return self.peak() + 8 * MiB

    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    made_at, began = {}, []

    def step(batch_size: int) -> None:
        began.append((batch_size, bool(optimizer.state)))
        if optimizer.state and made_at["size"] != batch_size and batch_size in wall_sizes:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")
        model(torch.randn(batch_size, 64)).square().mean().backward()
        if not optimizer.state:
            made_at["size"] = batch_size
        optimizer.step()
        optimizer.zero_grad()

    watch = LazyStateWatch()
    runner = TrialRunner(step, Fragmented(device), steps=3, search_steps=1, settle_final=True,
                         peak_limit=60 * MiB, pinned=PinnedState(watch))
    return runner, began, watch


def test_a_settle_trial_at_the_wall_beside_state_made_at_a_nearby_size_runs_again_without_it():
    """The state an earlier trial made at a nearby size is dropped and the trial runs once more,
    its first step creating the state as training's first step in a new process does."""
    with simulated_memory("64MiB") as device:
        runner, began, watch = _pinned_runner(device, wall_sizes={12})
        with watch:
            assert runner(8)  # the first trial: three steps, creates the state
            assert runner(12, final=True)  # may be the answer: at the wall beside 8's state, then again without it
    assert began == [(8, False), (8, True), (8, True), (12, True), (12, False), (12, True), (12, True)]
    assert [(r.batch_size, r.passed) for r in runner.records] == [(8, True), (12, True)]


@pytest.mark.parametrize("first, final", [(4, True), (8, False)])
def test_state_made_far_below_or_a_search_trial_at_the_wall_is_not_run_again(first, final):
    """State made at under half the size is kept (dropping it too made ViT-B/16's probes slower
    than Accelerate's: docs/promise-log.md), and a search trial only tells a side of the boundary:
    both fail as they ran, with the state kept."""
    with simulated_memory("64MiB") as device:
        runner, began, watch = _pinned_runner(device, wall_sizes={12})
        with watch:
            assert runner(first)
            assert not runner(12, final=final)
    assert began[3:] == [(12, True)]
    assert runner.records[-1].wall_bytes == 8 * MiB


def test_a_size_the_passing_sizes_put_past_the_limit_is_not_run_again():
    """GPT-2 small on an H200 (8 GiB cap, limit 8110 MiB): 4 and 6 passed at 4607 and 7717 MiB,
    so 7 needs ~9272 MiB and no layout trains it; 6 itself passed a step under the limit; the
    Llama decoder's 5, with only 4 passed (5185 MiB), is put at 6481 MiB through the origin."""
    from autobatch.probe.pinned_state import fits

    gpt2 = {4: 4607 * MiB, 6: 7717 * MiB}
    assert not fits(7, gpt2, 8110 * MiB)
    assert fits(6, gpt2, 8110 * MiB)
    assert fits(5, {4: 5185 * MiB}, 8110 * MiB)
    assert not fits(7, {4: 5185 * MiB}, 8110 * MiB)  # 9074 MiB through the origin
    assert fits(7, {}, 8110 * MiB) and fits(7, gpt2, None)  # nothing known: the wall decides
    assert fits(5, {4: 4607 * MiB, 6: 7717 * MiB, 9: None}, 8110 * MiB)  # 6 passed: 5 fits under its peak


def test_pinned_state_remembers_the_size_that_made_the_state_it_holds():
    """Only state still held counts (the runner observes after a failed trial's clean-up, which
    drops what a failed optimizer step half-made), the first size that made it, and a drop
    forgets it."""
    from autobatch.memory.lazy_state import LazyStateWatch
    from autobatch.probe.pinned_state import PinnedState

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    with LazyStateWatch() as watch:
        pinned = PinnedState(watch)
        pinned.observe(3)  # no step ran: no state
        assert pinned.made_at is None
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        pinned.observe(4)
        pinned.observe(5)  # the state is 4's
        assert pinned.made_at == 4
        assert not pinned.drop_if_pinning(9)  # made at under half of 9: kept
        assert pinned.drop_if_pinning(8) and not optimizer.state and pinned.made_at is None
        pinned.observe(6)
        assert pinned.made_at is None


def _expandable_runner(monkeypatch, memory: FlushingMemory, step, expandable: bool = True) -> TrialRunner:
    """A settling runner whose trials run under expandable segments (or not) on a CUDA-named device."""
    import autobatch.memory.allocator as allocator

    monkeypatch.setattr(allocator, "expandable_segments", lambda: expandable)
    memory.device = torch.device("cuda", 0)  # the setting is CUDA's
    return settling_runner(memory, step)


@pytest.mark.parametrize("expandable", [True, False])
@pytest.mark.parametrize("hand_loop", [True, False])
def test_a_hand_loop_steps_below_a_size_whose_next_size_up_kept_flushing(cudnn_flags, monkeypatch, expandable, hand_loop):
    """With expandable segments a new process met the flushing wall one size lower than the
    trials (ViT-B/16 on an H200: the trials flushed from 103, new processes from 102, which ran
    out of memory at step 23-32): a plain callable's answer below a size that failed still
    flushing steps down one size, through a full trial, and says why. A TrainStep's (its Runner
    replays a step) and any answer under fixed segments stay where the settle trials put them
    (below the sizes that kept flushing)."""
    from autobatch.probe.searching.search import run_search

    torch.backends.cudnn.benchmark = False
    with simulated_memory("64MiB") as device:
        memory = FlushingMemory(device)
        runner = _expandable_runner(monkeypatch, memory, flushing_step(memory, from_size=51), expandable)
        result = run_search(runner, strategy="binary", start=None, max_batch=None, margin=0.0, multiple_of=1,
                            device_name="sim", capacity=64 * MiB, confirm=True, hand_loop=hand_loop)
    steps_down = expandable and hand_loop
    assert runner.flushed_out(51) and not runner.outcomes[51]  # fixed segments too: the wall, not the peak limit
    assert result.largest_passed == 50
    assert result.batch_size == result.largest_passed - steps_down
    # the answer passed a full trial (the confirmation's bisection may have tried the size above it after)
    assert any(r.batch_size == result.batch_size and r.passed and r.steps >= 3 for r in runner.records)
    if steps_down:
        assert any((r.batch_size, r.passed, r.purpose) == (49, True, "confirm") for r in runner.records)
    moving = [note for note in result.notes if "lays its memory out afresh" in note]
    assert bool(moving) is steps_down
    if steps_down:
        assert moving[0].startswith("49, one size below 50") and "51 kept flushing" in moving[0]


def test_no_step_down_where_the_size_above_failed_for_another_reason(cudnn_flags, monkeypatch):
    """Only a failure still flushing marks the moving wall: a size above that ran out of memory
    or passed the peak limit says nothing about the layout, and the answer stands."""
    from autobatch.probe.searching.search import below_moving_wall

    torch.backends.cudnn.benchmark = False
    with simulated_memory("64MiB") as device:
        memory = FlushingMemory(device)
        runner = _expandable_runner(monkeypatch, memory, flushing_step(memory, from_size=10**9))
        over = 60 * MiB // 1000 + 1  # past the 60 MiB peak limit at 1000 bytes a sample, no flushing
        assert not runner.run(over, "verify", settle=True).passed
        assert runner.run(over - 1, "verify", settle=True).passed
        assert below_moving_wall(runner, over - 1, 1, after_last_oom=True) == over - 1
        assert not runner.flushed_out(over) and len(runner.records) == 2  # no trial run


@pytest.mark.parametrize("hand_loop", [True, False])
def test_under_fixed_segments_a_hand_loops_settle_trial_fails_while_its_steps_still_flush(cudnn_flags, hand_loop):
    """Untuned, fixed segments: a resumed hand loop (optimizer state made before its first step)
    ran out of memory at ResNet-50's flushing answer on an H200, so a plain callable's settle trial
    keeps stepping and fails if its last step still flushes; so does a TrainStep's, though its
    Runner replays a step (ResNet-101's Runner ran out of memory at such an answer in every
    process), with its own reason."""
    torch.backends.cudnn.benchmark = False
    with simulated_memory("64MiB") as device:
        memory = FlushingMemory(device)
        runner = TrialRunner(flushing_step(memory, from_size=50), memory, steps=3, peak_limit=60 * MiB,
                             autotune=Autotune(torch.device("cuda")), settle_final=True, hand_loop=hand_loop)
        flushing = runner.run(50, "verify", settle=True)
        settled = runner.run(40, "verify", settle=True)
    assert settled.passed and settled.steps == 3
    assert not flushing.passed and flushing.steps == 6 and runner.flushed_out(50)
    assert ("resumed from a checkpoint" if hand_loop else "replay of a step") in flushing.error


@pytest.mark.parametrize("hand_loop", [True, False])
def test_a_hand_loops_trials_each_start_without_the_cublas_workspaces(monkeypatch, hand_loop):
    """Each trial of a hand loop starts without the cuBLAS workspaces, as a new process's first
    step does (released again after a failed trial, so they never count as its leftover); a
    TrainStep's trials keep them."""
    released = []
    monkeypatch.setattr("autobatch.probe.trial.release_workspaces",
                        lambda device: device is not None and released.append(device))
    with simulated_memory("64MiB") as device:
        memory = FlushingMemory(device)
        memory.device = torch.device("cuda")  # as an accelerator's memory names its device
        runner = TrialRunner(flushing_step(memory, from_size=10**9), memory, steps=2, hand_loop=hand_loop)
        assert runner(10)
        assert not runner(10**6)  # out of memory: released before the trial and after it
    assert released == ([torch.device("cuda")] * 3 if hand_loop else [])


def test_a_hand_loops_settle_trials_run_beside_state_laid_out_as_a_resumed_run_has_it(cudnn_flags):
    """The layout runs before every attempt of a settle trial (a size that may be the answer),
    after the cache was returned, and never before a search trial."""
    torch.backends.cudnn.benchmark = False
    events = []
    with simulated_memory("64MiB") as device:
        memory = FlushingMemory(device)
        release = memory.release_cached
        memory.release_cached = lambda: (events.append("release"), release())
        step = flushing_step(memory, from_size=10**9)
        runner = TrialRunner(lambda n: (events.append(n), step(n)), memory, steps=2, settle_final=True,
                             hand_loop=True, layout=lambda: events.append("resumed"))
        assert runner(10)  # a search trial
        assert runner(20, final=True)  # may be the answer: it settles
        assert runner.run(30, "confirm", settle=True).passed
    assert events == ["release", 10, 10, "release", "resumed", 20, 20, "release", "resumed", 30, 30]


@pytest.mark.parametrize("wall", [56_000, 62_000])
def test_below_a_size_that_kept_flushing_every_trial_is_a_full_one(cudnn_flags, wall):
    """A one-step trial cannot see flushing: below a size whose settle trial kept flushing, the
    predictive search runs only full (settle) trials, in strides of a percent that double, then
    bisects to within a percent (ResNet-50 as a plain callable on an H200 paid two one-step trials
    of 0.2 s each there). The answer is the largest size found that stops flushing."""
    from autobatch.probe.searching.search import run_search

    torch.backends.cudnn.benchmark = False
    with simulated_memory("64MiB") as device:
        memory = FlushingMemory(device)
        runner = TrialRunner(flushing_step(memory, from_size=wall), memory, steps=3, peak_limit=60 * MiB,
                             settle_final=True, hand_loop=True, search_steps=1)
        result = run_search(runner, strategy="predict", start=None, max_batch=None, margin=0.0, multiple_of=1,
                            device_name="sim", capacity=64 * MiB, confirm=True, hand_loop=True)
    first = next(i for i, r in enumerate(runner.records) if r.error and "return its cache" in r.error)
    below = runner.records[first + 1:]
    assert below and all(r.steps >= 3 for r in below)  # full trials only
    assert all(not r.passed for r in below if r.batch_size >= wall)
    assert wall * 0.99 <= result.batch_size < wall
    assert len(below) <= 8


def test_a_hand_loops_train_steps_answer_steps_down_until_it_passes_in_the_fresh_layout_too(cudnn_flags):
    """A hand loop's TrainStep (a Trainer's loop) gets its optimizer state back dropped, so
    training makes it in its first step: the answer must pass a settle trial in that layout too;
    where it does not, the largest size that does is confirmed again in the resumed layout."""
    from autobatch.probe.fresh_layout import in_fresh_layout
    from autobatch.probe.searching.search import _confirm

    torch.backends.cudnn.benchmark = False
    layout = {"now": None}
    with simulated_memory("64MiB") as device:
        memory = FlushingMemory(device)

        def step(batch_size: int) -> None:
            if layout["now"] == "fresh" and batch_size > 40:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
            torch.empty(batch_size * 1000, dtype=torch.uint8)

        runner = TrialRunner(step, memory, steps=3, peak_limit=60 * MiB, settle_final=True, hand_loop=True,
                             layout=lambda: layout.update(now="resumed"))
        assert runner.run(42, "confirm", settle=True).passed
        found = in_fresh_layout(runner, 42, 1, lambda: layout.update(now="fresh"),
                                lambda units: _confirm(runner, units, 1, after_last_oom=True))
    assert found == 40
    tried = [(r.batch_size, r.purpose, r.passed) for r in runner.records]
    assert tried == [(42, "confirm", True), (42, "fresh", False), (41, "fresh", False), (40, "fresh", True),
                     (40, "confirm", True)]


def test_the_fresh_layouts_search_aims_where_the_bytes_a_failure_was_over_are_saved(cudnn_flags):
    """Below a size that fails in the fresh layout, the next trial is where the bytes it was over
    are saved at the answer's own bytes per unit, then a bisection: not a unit at a time (an LSTM
    language model on an H200 failed there from 59 down to 52: 18 trials)."""
    from autobatch.probe.fresh_layout import in_fresh_layout
    from autobatch.probe.searching.search import _confirm

    torch.backends.cudnn.benchmark = False
    layout = {"now": None}
    with simulated_memory("64MiB") as device:
        memory = FlushingMemory(device)

        def step(batch_size: int) -> None:
            held = torch.empty(batch_size * 1_000_000, dtype=torch.uint8)
            if layout["now"] == "fresh" and batch_size > 51:  # 1.5 MB over per sample past 51
                wanted = 60 * MiB + (batch_size - 51) * 1_500_000 - memory.allocated()
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {wanted / MiB:.2f} MiB")
            del held

        runner = TrialRunner(step, memory, steps=3, peak_limit=60 * MiB, settle_final=True, hand_loop=True,
                             layout=lambda: layout.update(now="resumed"))
        assert runner.run(59, "confirm", settle=True).passed
        found = in_fresh_layout(runner, 59, 1, lambda: layout.update(now="fresh"),
                                lambda units: _confirm(runner, units, 1, after_last_oom=True))
    fresh = [(r.batch_size, r.passed) for r in runner.records if r.purpose == "fresh"]
    assert found == 51
    assert fresh[0] == (59, False) and 45 <= fresh[1][0] <= 51 and (52, False) in fresh and len(fresh) <= 6
    assert runner.records[-1].purpose == "confirm" and runner.records[-1].batch_size == 51


@pytest.mark.parametrize("form", ["plain", "trainstep", "trainstep-replayed"])
def test_a_hand_loops_train_step_is_always_checked_in_the_fresh_layout(monkeypatch, form):
    """Training from scratch makes its optimizer state in its first step: a hand loop's TrainStep
    (whose state the restore drops) is always checked in that layout, a plain callable and a
    TrainStep the Runner trains only where the step's requests are large (the simulated device
    reports no segments: never)."""
    import autobatch.probe.find as find_module

    seen = []
    real = find_module.run_search
    monkeypatch.setattr(find_module, "run_search", lambda runner, **kw: seen.append(kw["fresh_layout"]) or real(runner, **kw))
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    step = TrainStep(model, optimizer, lambda m, b: m(b).square().mean(), lambda n: torch.randn(n, 8))
    fn = (lambda n: step(n)) if form == "plain" else step
    with simulated_memory("4MiB"):
        find_max_batch(fn, strategy="binary", max_batch=64, hand_loop=form != "trainstep-replayed", cache=False)
    assert seen[0].needed(4 * MiB) == (form == "trainstep")


class SegmentedMemory(FlushingMemory):
    """The simulated device reporting its largest segment, as CUDA's allocator does under fixed
    segments."""

    largest = 0

    def largest_segment(self) -> int:
        return self.largest


@pytest.mark.parametrize("largest_mib, answer", [(8, 40), (4, 42)])
def test_a_plain_callables_answer_is_checked_in_the_fresh_layout_where_its_requests_are_large(
        cudnn_flags, largest_mib, answer):
    """A new process makes a hand loop's optimizer state among its first step's activations, and
    under fixed segments that can cost up to one of the step's largest requests (an LSTM whose loss
    reads 2 GiB of logits, 8 GiB cap, H200): where the largest request is at least a tenth of the
    capacity the answer must pass that layout too; smaller ones keep the answer the trials found."""
    from autobatch.probe.fresh_layout import FreshLayout
    from autobatch.probe.searching.search import run_search

    torch.backends.cudnn.benchmark = False
    layout = {"now": None}
    with simulated_memory("64MiB") as device:
        memory = SegmentedMemory(device)
        memory.largest = largest_mib * MiB

        def step(batch_size: int) -> None:
            if batch_size > 42 or (layout["now"] == "fresh" and batch_size > 40):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
            torch.empty(batch_size * 1000, dtype=torch.uint8)

        runner = TrialRunner(step, memory, steps=3, peak_limit=60 * MiB, settle_final=True, hand_loop=True,
                             layout=lambda: layout.update(now="resumed"))
        result = run_search(runner, strategy="binary", start=None, max_batch=64, margin=0.0, multiple_of=1,
                            device_name="sim", capacity=64 * MiB, confirm=True, hand_loop=True,
                            fresh_layout=FreshLayout(lambda: layout.update(now="fresh"), memory))
    assert result.batch_size == answer
    assert any(r.purpose == "fresh" for r in runner.records) == (answer == 40)


def _wall_band_step(memory: FlushingMemory, *, wall: int, band: int, bytes_per_sample: int):
    """A step at ``bytes_per_sample`` a sample that flushes at every call from ``wall`` up, and in a
    trial's first three calls only in the ``band`` sizes just below it (they settle)."""
    calls = {}

    def step(batch_size: int) -> None:
        calls[batch_size] = calls.get(batch_size, 0) + 1
        torch.empty(batch_size * bytes_per_sample, dtype=torch.uint8)
        if batch_size >= wall or (batch_size >= wall - band and calls[batch_size] % 6 in (1, 2, 3)):
            memory.retries += 1

    return step


@pytest.mark.parametrize("band", [0, 2])
def test_an_answer_whose_own_trial_flushed_below_a_size_that_kept_flushing_settles_the_size_above(cudnn_flags, band):
    """Below a size that kept flushing, a passing size whose own settle trial flushed before it
    settled met the wall too: within two percent of the flushing size (at 100 units or more) the
    size above it is not tried, and a note says why (ResNet-50 as a plain callable on an H200: 180
    and 179 kept flushing, 177 stopped at its sixth step, and 178's trial, 0.62 s, kept flushing).
    An answer whose trial never flushed is bracketed by trials as before."""
    from autobatch.probe.searching.search import run_search

    torch.backends.cudnn.benchmark = False
    with simulated_memory("64MiB") as device:
        memory = FlushingMemory(device)
        step = _wall_band_step(memory, wall=200, band=band, bytes_per_sample=300_000)
        runner = TrialRunner(step, memory, steps=3, peak_limit=60 * MiB, settle_final=True, hand_loop=True,
                             search_steps=1)
        result = run_search(runner, strategy="predict", start=None, max_batch=None, margin=0.0, multiple_of=1,
                            device_name="sim", capacity=64 * MiB, confirm=True, hand_loop=True)
    tried = [r.batch_size for r in runner.records]
    notes = [note for note in result.notes if "was not tried" in note and "flush" in note]
    answer = result.batch_size
    if band:
        assert 200 - band <= answer < 200 and runner.passed_record(answer).flushes
        assert answer + 1 not in tried and result.fit["at_wall_above"] == {"batch_size": answer + 1}
        assert notes and notes[0].startswith(f"{answer + 1} was not tried: {answer}'s own trial made the allocator")
    else:  # 199 never flushed: bracketed by trials as before
        assert answer == 199 and not notes and "at_wall_above" not in result.fit
    assert tried.count(answer) == 1  # its settle trial stands: no confirmation after a flushing failure
