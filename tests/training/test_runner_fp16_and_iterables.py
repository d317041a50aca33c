"""The runner's inputs: any iterable (one-shot generators, IterableDataset loaders) loses no
sample when the micro-batch is planned on it, and fp16 with a GradScaler survives OOMs."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from autobatch import FaultInjector, Runner
from runner_workloads import hungry_mse, make_data, make_model

GLOBAL, SAMPLES = 16, 80
PLAN = {"memory_limit": 1_100_000, "strategy": "binary", "max_batch": GLOBAL}  # 16 does not fit


class Recorder:
    """Which samples each *committed* step trained: loss_fn notes ids, on_step_end commits."""

    def __init__(self) -> None:
        self.pending: list[int] = []
        self.applied: list[int] = []

    def loss_fn(self, model, batch):
        ids = batch[2].tolist()
        if ids[0] % GLOBAL == 0:
            self.pending = []  # a step (or a planning trial) starts from the global batch's first sample
        self.pending.extend(ids)
        return hungry_mse(model, batch)

    def on_step_end(self, info) -> None:
        self.applied.extend(self.pending)
        self.pending = []


def fit(data, **fit_args):
    recorder = Recorder()
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.05), recorder.loss_fn, global_batch=GLOBAL,
                    micro_batch=None, progress=False, plan_options=PLAN)
    result = runner.fit(data, on_step_end=recorder.on_step_end, **fit_args)
    return result, recorder


class Stream(IterableDataset):
    """A stream that can be read once (like a socket or a queue behind an IterableDataset)."""

    def __init__(self) -> None:
        self.batches = iter(make_data(SAMPLES, 1))

    def __iter__(self):
        for x, y, ids in self.batches:
            yield x[0], y[0], ids[0]


@pytest.mark.parametrize(("source", "limit"), [
    ("generator", {"epochs": 1}), ("generator", {"steps": 3}), ("iterable_dataset", {"steps": 5}),
])
def test_a_one_shot_iterable_trains_every_sample_once(source, limit):
    data = (b for b in make_data(SAMPLES, GLOBAL)) if source == "generator" else DataLoader(Stream(), batch_size=GLOBAL)
    result, recorder = fit(data, **limit)
    steps = limit.get("steps", SAMPLES // GLOBAL)
    assert result.plan is not None and result.initial_micro_batch < GLOBAL
    assert result.steps == steps
    assert recorder.applied == list(range(steps * GLOBAL))


def test_more_steps_than_a_generator_holds_is_a_clear_error():
    with pytest.raises(ValueError, match="one-shot"):
        fit((b for b in make_data(SAMPLES, GLOBAL)), steps=6)


def test_empty_data_with_a_planned_micro_batch_is_a_clear_error():
    with pytest.raises(ValueError, match="no batches"):
        fit([], steps=3)


# -- fp16 with a GradScaler ---------------------------------------------------------------------
def fp16_run(faults=None, oom_inside_step_at=None):
    """fp16 autocast + GradScaler on the CPU. Batches 1 and 3 hold a non-finite sample, so the
    scaler skips those steps and backs off (and grows back every 2 good steps), as on a GPU;
    which steps overflow then does not depend on the micro-batch, so a replayed run with
    halved micro-batches must make the same decisions as the uninjected one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 1))
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(GLOBAL, 6, generator=generator), torch.randn(GLOBAL, 1, generator=generator))
            for _ in range(6)]
    data[1][0][5, 2] = float("inf")
    data[3][0][12, 0] = float("nan")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # Adam would amplify fp16 noise in ~0 grads
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    runner = Runner(model, optimizer, lambda m, b: nn.functional.mse_loss(m(b[0]).float(), b[1]),
                    global_batch=GLOBAL, micro_batch=8, autocast_dtype="float16", grad_scaler=scaler,
                    progress=False, faults=faults, balanced=False)
    failed = []
    if oom_inside_step_at is not None:
        def oom_once(*_):  # inside scaler.step, after unscale_ recorded this optimizer
            if runner.step == oom_inside_step_at and not failed:
                failed.append(runner.step)
                raise torch.OutOfMemoryError("simulated OOM inside optimizer.step")
        optimizer.register_step_pre_hook(oom_once)
    result = runner.fit(data, epochs=2)
    return runner, result, scaler, failed


@pytest.fixture(scope="module")
def fp16_reference():
    runner, result, scaler, _ = fp16_run()
    assert result.skipped_steps == 4 and result.steps == 12  # batches 1 and 3, in each of 2 epochs
    return [p.detach().clone() for p in runner.model.parameters()], scaler.state_dict(), result.skipped_steps


def assert_same_run(runner, result, scaler, reference) -> None:
    weights, scaler_state, skipped = reference
    assert scaler.state_dict() == scaler_state and result.skipped_steps == skipped
    for ours, theirs in zip(runner.model.parameters(), weights):
        # fp16 forward over micro-batches of another size: summation order differs a little
        torch.testing.assert_close(ours.detach(), theirs, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(("step", "phase"), [(0, "backward"), (4, "forward"), (5, "optimizer")])
def test_fp16_scaler_replay_ends_as_the_uninjected_run(fp16_reference, phase, step):
    times = 1 if phase == "optimizer" else 2  # the optimizer step's OOM is replayed once, at the same micro-batch
    runner, result, scaler, _ = fp16_run(FaultInjector((step, phase), times=times))
    assert len(result.oom_recoveries) == times and result.micro_batch == (8 if phase == "optimizer" else 2)
    assert_same_run(runner, result, scaler, fp16_reference)


def test_fp16_oom_inside_the_scaler_step_is_replayed(fp16_reference):
    """After unscale_ the scaler marks the optimizer; a replay that kept the mark would raise
    'unscale_() has already been called' or skip on the failed attempt's inf check."""
    runner, result, scaler, failed = fp16_run(oom_inside_step_at=8)
    assert failed == [8] and [r["phase"] for r in result.oom_recoveries] == ["optimizer"]
    assert_same_run(runner, result, scaler, fp16_reference)


def test_skipped_steps_are_counted_without_reading_the_scale_each_step(monkeypatch, fp16_reference):
    """``GradScaler.get_scale()`` reads the scale with ``.item()``: on a GPU the host waited for
    the device twice a step to count skipped steps. The runner now compares the scale tensors on
    the device and reads the count when it reports it: the same count, no read per step."""
    reads = []
    original = torch.amp.GradScaler.get_scale
    monkeypatch.setattr(torch.amp.GradScaler, "get_scale", lambda self: reads.append(self._scale) or original(self))
    runner, result, scaler, _ = fp16_run()
    assert result.skipped_steps == fp16_reference[2] == 4
    assert all(scale is None for scale in reads)  # only the initial scale, before the first step made the tensor


class LazyShuffle(IterableDataset):
    """Draws each next sample as it goes (a shuffle buffer's way), from torch's global generator
    or from ``generator``, one it holds (which a checkpoint saves)."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __iter__(self):
        x = torch.linspace(-1, 1, 24, dtype=torch.float64).reshape(24, 1)
        remaining = list(range(24))
        while remaining:
            i = remaining.pop(int(torch.randint(len(remaining), (), generator=self.generator)))
            yield x[i], x[i] * 2, i


def test_review36_resume_warns_where_the_data_draws_its_order_between_steps(tmp_path, caplog):
    """A shuffle drawn batch by batch from torch's generator, in a run whose dropout draws from it
    between the batches: the resume's replay draws the skipped batches with no step in between, so
    the rest of the epoch is other samples (3 twice, 3 never, for this one), which was silent.
    Held on the dataset as its own generator, the same shuffle resumes exactly, without a warning."""
    for generator, warned in ((None, True), (torch.Generator().manual_seed(1), False)):
        seen: list[int] = []

        def loss(model, batch):
            seen.extend(batch[2].tolist())
            return nn.functional.mse_loss(model(batch[0]), batch[1])

        def runner(folder):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(1, 4), nn.Dropout(0.5), nn.Linear(4, 1)).double()
            return Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss, global_batch=4, micro_batch=4,
                          progress=False, checkpoint_dir=folder)

        folder = tmp_path / str(warned)
        runner(folder).fit(DataLoader(LazyShuffle(generator), batch_size=4), steps=3)
        caplog.clear()
        runner(folder).fit(DataLoader(LazyShuffle(generator), batch_size=4), epochs=1, resume=folder)
        assert ("may train some samples twice" in caplog.text) is warned
        assert (sorted(seen) == list(range(24))) is not warned


class PositionedStream(Stream):
    """A stream that keeps its own position, as a Hugging Face ``datasets`` streaming set does."""

    def state_dict(self):
        return {}

    def load_state_dict(self, state) -> None:
        pass


@pytest.mark.parametrize("held", ["dataset", "sampler"])
def test_review39_extra_state_holding_the_stream_is_refused(held):
    dataset = PositionedStream()
    loader = DataLoader(dataset, batch_size=GLOBAL)
    holder = dataset if held == "dataset" else loader.sampler
    if held == "sampler":
        holder.state_dict, holder.load_state_dict = dict, lambda state: None
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.05), hungry_mse, global_batch=GLOBAL,
                    micro_batch=4, progress=False, extra_state={"stream": holder})
    with pytest.raises(ValueError, match=rf"extra_state\['stream'\] is the data fit\(\) trains on \(data.{held}\)"):
        runner.fit(loader, steps=2)
    assert runner.step == 0
