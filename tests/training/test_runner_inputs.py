"""What users hand the runner: one-shot iterables lose no sample, and bad arguments are one
clear error naming the argument."""

from __future__ import annotations

import pytest
import torch

from autobatch import Runner
from runner_workloads import SampleTracker, make_data, make_model, mse

GLOBAL, SAMPLES = 16, 80


def _generator():
    yield from make_data(SAMPLES, GLOBAL)


def _planned_run(data, **fit):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    tracker = SampleTracker(optimizer, GLOBAL)
    runner = Runner(model, optimizer, tracker.loss_fn, global_batch=GLOBAL, progress=False,
                    plan_options={"memory_limit": "4MiB"})
    result = runner.fit(data, **fit)
    trained = tracker.applied[-result.steps_this_run:]  # the planner's trials step the optimizer too
    return result, trained


@pytest.mark.parametrize("fit", [{"epochs": 1}, {"steps": 5}, {"steps": 3}])
def test_a_generator_with_a_planned_micro_batch_trains_every_sample_once(fit):
    result, trained = _planned_run(_generator(), **fit)
    steps = fit.get("steps", SAMPLES // GLOBAL)
    assert result.steps == steps
    assert [ids for step in trained for ids in step] == list(range(steps * GLOBAL))


def test_an_iterable_dataset_loader_loses_no_sample():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from _generator()

    loader = torch.utils.data.DataLoader(Stream(), batch_size=None)
    result, trained = _planned_run(loader, epochs=1)
    assert sorted(i for step in trained for i in step) == list(range(SAMPLES))


def test_empty_data_is_a_clear_error_not_a_bare_stop_iteration():
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=GLOBAL, progress=False)
    with pytest.raises(ValueError, match="data yielded no batches"):
        runner.fit([], steps=3)


def _runner(**changes):
    model = make_model()
    arguments = dict(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=mse, global_batch=GLOBAL)
    arguments.update(changes)
    if arguments.get("scheduler") == "plateau":  # ReduceLROnPlateau needs a metric the runner has not got
        arguments["scheduler"] = torch.optim.lr_scheduler.ReduceLROnPlateau(arguments["optimizer"])
    return Runner(arguments.pop("model"), arguments.pop("optimizer"), arguments.pop("loss_fn"), **arguments)


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"model": "not a model"}, TypeError, "model must be a torch.nn.Module"),
        ({"optimizer": 3}, TypeError, "optimizer must be a torch.optim.Optimizer"),
        ({"optimizer": torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)}, ValueError,
         "optimizer holds none of the model's parameters"),
        ({"loss_fn": 5}, TypeError, "loss_fn must be a callable"),
        ({"global_batch": 0}, ValueError, "global_batch must be a positive integer"),
        ({"micro_batch": 2.5}, ValueError, "micro_batch must be a positive integer or None"),
        ({"device": "tpu9"}, ValueError, "device='tpu9' is not a torch device"),
        ({"autocast_dtype": "float17"}, ValueError, "autocast_dtype='float17' is not a torch dtype"),
        ({"step_guard": "maybe"}, ValueError, "step_guard must be one of"),
        ({"grow_after": -1}, ValueError, "grow_after must be"),
        ({"scheduler": 3}, TypeError, "scheduler must be an LR scheduler"),
        ({"scheduler": "plateau"}, ValueError, "scheduler=ReduceLROnPlateau needs a metric.*extra_state="),
    ],
)
def test_bad_runner_arguments_name_the_argument(changes, error, match):
    with pytest.raises(error, match=match):
        _runner(**changes)


@pytest.mark.parametrize(
    ("data", "fit", "error", "match"),
    [
        (5, {}, TypeError, "data must be an iterable"),
        (make_data(), {"steps": 0}, ValueError, "steps must be a positive integer or None"),
        (make_data(), {"epochs": -1}, ValueError, "epochs must be a positive integer or None"),
    ],
)
def test_bad_fit_arguments_name_the_argument(data, fit, error, match):
    with pytest.raises(error, match=match):
        _runner(micro_batch=8).fit(data, **fit)


def test_a_distributed_sampler_is_told_each_epoch():
    """A DistributedSampler shuffles by the epoch it is told: the runner, which owns the epoch
    loop, calls set_epoch, so each epoch draws its own order (the same order every epoch before)."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    data = TensorDataset(torch.randn(32, 4), torch.arange(32))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    seen: list[list[int]] = []
    model = torch.nn.Linear(4, 1)

    def loss_fn(m, batch):
        seen.append(batch[1].tolist())
        return m(batch[0]).square().mean()

    Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, global_batch=8, micro_batch=8,
           progress=False).fit(loader, epochs=3)
    orders = [sum(seen[i:i + 4], []) for i in range(0, 12, 4)]
    expected = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        expected.append(list(iter(sampler)))
    assert orders == expected and orders[0] != orders[1]


def test_the_runners_plan_builds_per_sample_lists_with_the_tensors():
    """The runner plans its micro-batch on batches built from the first global batch: a list of
    per-sample values (file names) grows with the tensors there, as split_batch splits it after
    (the planner's batches kept the first batch's list, and a loss pairing them failed)."""
    from autobatch import simulated_memory

    model = torch.nn.Linear(4, 1)
    batches = [(torch.randn(16, 4), [f"file{i}" for i in range(16)]) for _ in range(2)]

    def loss_fn(m, batch):
        assert len(batch[1]) == batch[0].shape[0], (len(batch[1]), batch[0].shape[0])
        return m(batch[0]).square().mean()

    with simulated_memory("64MiB"):
        result = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, global_batch=16,
                        progress=False).fit(batches, epochs=1)
    assert result.steps == 2


def test_an_optimizer_step_that_never_fits_is_not_advised_checkpointing():
    """Activation checkpointing shrinks activations, not the optimizer's step: the advice follows
    the phase that ran out of memory."""
    from autobatch import StepOutOfMemoryError

    in_backward = str(StepOutOfMemoryError(3, "backward", False))
    in_optimizer = str(StepOutOfMemoryError(3, "optimizer", False))
    assert "checkpointing_fallback=True" in in_backward
    assert "checkpointing_fallback" not in in_optimizer and "optimizer with less state" in in_optimizer


@pytest.mark.parametrize("data", [torch.randn(4, 6, dtype=torch.float64), {"x": torch.randn(4, 6)}], ids=["tensor", "dict"])
def test_one_batch_passed_as_data_is_one_clear_error(data):
    """A tensor was iterated row by row (each row a 'batch'), and the model failed with "both
    arguments to linear need to be at least 1D"; a dict yields its keys."""
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=4, micro_batch=2,
                    progress=False)
    with pytest.raises(TypeError, match=r"data must be an iterable of global batches .* pass \[batch\]"):
        runner.fit(data)
    assert runner.step == 0


def test_a_loss_held_in_a_dict_trains_as_the_tensor_and_a_tuple_is_one_clear_error():
    """The Runner's step takes the loss as TrainStep does (autobatch.checks.loss): a dict's or a
    model output's "loss"; before, the dict was multiplied by the micro-batch's weight
    ("unsupported operand type(s) for *: 'dict' and 'float'")."""
    weights = []
    for loss_fn in (mse, lambda model, batch: {"loss": mse(model, batch), "logged": 1.0}):
        model = make_model()
        Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, global_batch=16, micro_batch=4,
               progress=False).fit(make_data(), steps=3)
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(weights[0], weights[1])
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: (mse(m, b), 0),
                    global_batch=16, micro_batch=4, progress=False)
    with pytest.raises(TypeError, match=r"loss_fn must return the loss as a scalar tensor .* its \[0\]"):
        runner.fit(make_data(), steps=1)


def test_review37_a_bad_plan_options_memory_limit_is_an_error_at_construction():
    """``plan_options={"memory_limit": "80%"}`` raised at ``fit()``, once the data's first batch was
    loaded, naming ``memory_limit`` alone; now at ``Runner(...)``, naming ``plan_options``."""
    with pytest.raises(ValueError, match=r"plan_options\['memory_limit'\]='80%': a percentage is not taken"):
        _runner(plan_options={"memory_limit": "80%"})
    with pytest.raises(ValueError, match=r"plan_options\['memory_limit'\]='none' is a string, not 'no limit'"):
        _runner(plan_options={"memory_limit": "none"})
    assert _runner(plan_options={"memory_limit": "8GiB"}).plan_options["memory_limit"] == "8GiB"
