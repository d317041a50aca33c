"""An out-of-memory error inside ``optimizer.step()`` does not shrink the micro-batch.

The optimizer step's memory does not depend on the micro-batch (activations are freed by then,
the gradients are as large at any size), yet such an OOM halved it: a transient squeeze there
cost the rest of the run half its micro-batch, and an optimizer step that never fits was
replayed at every halving down to 1 before the runner gave up. Now it is replayed at the same
micro-batch (the half-applied update undone), then, where the optimizer runs torch's foreach step,
with ``foreach=False``, then given up (:mod:`autobatch.training.oom.optimizer_phase`).
"""

from __future__ import annotations

import pytest
import torch

from autobatch import FaultInjector, Runner, StepOutOfMemoryError, simulated_memory
from autobatch.training.oom.recovery_vote import VotesRecovery
from runner_workloads import SampleTracker, assert_weights_close, make_data, make_model, mse, weights

GLOBAL, MICRO, SAMPLES = 16, 8, 48


class OOMAfterUpdate:
    """A step post-hook that raises a real OOM once, at its ``at_call``-th step: the update is applied."""

    def __init__(self, at_call: int) -> None:
        self.at_call, self.calls = at_call, 0

    def __call__(self, optimizer, args, kwargs) -> None:
        self.calls += 1
        if self.calls == self.at_call:
            raise torch.OutOfMemoryError("CUDA out of memory (test: inside optimizer.step())")


def _unsplit() -> list[torch.Tensor]:
    """The plain float64 loop: one backward per global batch, one step."""
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for batch in make_data(SAMPLES, GLOBAL):
        optimizer.zero_grad()
        mse(model, batch).backward()
        optimizer.step()
    return weights(model)


def test_review34_a_transient_oom_in_the_optimizer_step_replays_at_the_same_micro_batch():
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    optimizer.register_step_post_hook(OOMAfterUpdate(at_call=2))  # before the tracker's: a failed update is not counted
    tracker = SampleTracker(optimizer, GLOBAL)
    runner = Runner(model, optimizer, tracker.loss_fn, global_batch=GLOBAL, micro_batch=MICRO, progress=False,
                    log_every=None)
    result = runner.fit(make_data(SAMPLES, GLOBAL))
    assert [(r["step"], r["phase"], r["micro_batch_before"], r["micro_batch"], r["action"])
            for r in result.oom_recoveries] == [(1, "optimizer", MICRO, MICRO, "same")]
    assert result.steps == 3 and result.micro_batch == MICRO and len(tracker.applied) == 3
    assert sorted(i for step in tracker.applied for i in step) == list(range(SAMPLES))  # every sample once
    assert_weights_close(weights(runner.model), _unsplit())  # the half-applied update undone, replayed exactly


def _runner(faults=None) -> Runner:
    model = make_model()
    return Runner(model, torch.optim.Adam(model.parameters(), lr=1e-2), mse, global_batch=GLOBAL, micro_batch=MICRO,
                  progress=False, log_every=None, faults=faults, checkpointing_fallback=True)


def test_review34_an_optimizer_step_that_never_fits_is_given_up_after_one_replay():
    faults = FaultInjector((1, "optimizer"), times=None)
    runner, first = _runner(faults), _runner()
    first.fit(make_data(SAMPLES, GLOBAL)[:1])  # where the run stands before the step given up
    with pytest.raises(StepOutOfMemoryError) as info:
        runner.fit(make_data(SAMPLES, GLOBAL))
    message = str(info.value)
    assert "again when the step was replayed at the same micro-batch" in message
    assert "foreach=False" not in message  # Adam on the CPU steps per tensor already: nothing to switch
    assert "checkpointing_fallback" not in message and info.value.phase == "optimizer"
    assert faults.fired == [(1, "optimizer")] * 2  # not once per halving down to micro-batch 1
    assert [r["micro_batch"] for r in runner.result.oom_recoveries] == [MICRO] and runner.checkpoint_handle is None
    assert runner.micro_batch == MICRO and runner.step == 1  # the step undone, not counted
    assert_weights_close(weights(runner.model), weights(first.model))


class _Rank(VotesRecovery):
    """The distributed vote's inputs, one rank at its floor, its peer's row given."""

    _phase, multiple_of, min_micro_batch = "optimizer", 1, 4
    step = 3

    def __init__(self, peer: list[int]) -> None:
        self.peer, self.rows = peer, []

    def _at_floor(self) -> bool:
        return True

    def _checkpointed(self) -> bool:
        return False

    def _enable_checkpointing(self) -> None:
        raise AssertionError("activation checkpointing does not shrink the optimizer step")

    def _vote(self, *row) -> list[list[int]]:
        self.rows.append([row[0], *map(int, row[1:])])
        return [self.rows[-1], self.peer]


def test_review34_ranks_replay_an_optimizer_step_oom_at_the_same_size_even_at_their_floor():
    rank = _Rank(peer=[4, 0, 0, 0, 0])
    assert rank._agreed_recovery(4, None) == (4, "same")
    assert rank.rows == [[4, 0, 0, 0, 0]]  # no floor in its row: no peer turns checkpointing on


def _linear_stack(foreach: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(8)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)


def test_review34_a_foreach_step_that_does_not_fit_trains_per_tensor_and_bit_equal():
    """A real OOM: AdamW's foreach step allocates a temporary over the whole group (2 MiB here)
    that the 7 MiB cap has no room for, where the per-tensor step's fits. The runner replays at
    the same micro-batch, then switches the groups to foreach=False and trains every step, with
    the weights of a plain foreach=False loop to the bit."""
    torch.manual_seed(1)
    data = [(torch.randn(16, 256), torch.randn(16, 256)) for _ in range(3)]

    def loss_fn(model, batch):
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    model, optimizer = _linear_stack(foreach=True)
    with simulated_memory("7MiB"):
        result = Runner(model, optimizer, loss_fn, global_batch=16, micro_batch=16, progress=False,
                        log_every=None).fit(data)
    assert [(r["step"], r["phase"], r["micro_batch"], r["action"]) for r in result.oom_recoveries] == [
        (0, "optimizer", 16, "same"), (0, "optimizer", 16, "foreach")]
    assert result.steps == 3 and optimizer.param_groups[0]["foreach"] is False and optimizer.defaults["foreach"] is False
    plain, plain_optimizer = _linear_stack(foreach=False)
    for batch in data:
        plain_optimizer.zero_grad()
        loss_fn(plain, batch).backward()
        plain_optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))


def test_review34_a_foreach_step_that_never_fits_is_given_up_after_the_switch():
    model = make_model()
    faults = FaultInjector((1, "optimizer"), times=None)
    runner = Runner(model, torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True), mse, global_batch=GLOBAL,
                    micro_batch=MICRO, progress=False, log_every=None, faults=faults)
    with pytest.raises(StepOutOfMemoryError, match="and again with its param groups switched to foreach=False"):
        runner.fit(make_data(SAMPLES, GLOBAL))
    assert faults.fired == [(1, "optimizer")] * 3
    assert [r["action"] for r in runner.result.oom_recoveries] == ["same", "foreach"] and runner.step == 1


def _small_stack() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(128, 128) for _ in range(4)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)


def _small_loss(model, batch):
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


SMALL_CAP = "950KiB"  # the per-tensor AdamW step fits, the foreach one (a temporary over the group) does not


def test_review34_a_plan_whose_every_size_fails_in_a_foreach_step_names_foreach():
    """plan() walked down to batch 1 and advised activation checkpointing; each size had run out of
    memory inside optimizer.step(), which no batch size shrinks and foreach=False does. Called directly,
    it leaves the user's optimizer as built; on the command line the advice is the override."""
    from autobatch import NoBatchFitsError, TrainStep, plan
    from autobatch.cli.errors import cli_keys, describe

    model, optimizer = _small_stack()
    step = TrainStep(model, optimizer, _small_loss, lambda n: (torch.randn(n, 128), torch.randn(n, 128)))
    with simulated_memory(SMALL_CAP), pytest.raises(NoBatchFitsError) as info:
        plan(step, global_batch=4)
    assert "Batch 1 ran out of memory inside optimizer.step()" in str(info.value)
    assert "Build it with foreach=False" in str(info.value)
    assert optimizer.param_groups[0]["foreach"] is True and optimizer.defaults["foreach"] is True
    line = describe(info.value)[0]  # too long for one line: the note, mid-line, is said again at its end
    assert line.endswith("set +optimizer.foreach=false (train switches it itself when it plans the micro-batch)")
    assert "with foreach=False" not in line and "Set +optimizer.foreach=false (per-tensor" in cli_keys(str(info.value))


def test_review34_a_runner_planning_its_micro_batch_steps_per_tensor_where_foreach_does_not_fit(tmp_path, caplog):
    """micro_batch=None raised that NoBatchFitsError where a given micro-batch trained (the recovery
    switches to foreach=False): the runner's plan switches too, with one warning, plans again and trains
    every sample, bit-equal to a plain foreach=False loop; a resume keeps the switch and says why."""
    torch.manual_seed(1)
    data = [(torch.randn(4, 128), torch.randn(4, 128)) for _ in range(2)]
    options = dict(global_batch=4, micro_batch=None, progress=False, log_every=None, checkpoint_dir=tmp_path,
                   checkpoint_every=1, plan_options={"allow_checkpointing": False})  # no block to wrap: faster
    model, optimizer = _small_stack()
    with simulated_memory(SMALL_CAP):
        result = Runner(model, optimizer, _small_loss, **options).fit(data, steps=1)
    warned = [r.getMessage() for r in caplog.records if "foreach=False" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("plan(): every micro-batch down to 1 ran out of memory inside")
    assert result.steps == 1 and result.micro_batch == 4 and result.plan["foreach_dropped"] is True
    assert optimizer.param_groups[0]["foreach"] is False and optimizer.defaults["foreach"] is False
    resumed, optimizer = _small_stack()
    caplog.clear()
    with simulated_memory(SMALL_CAP):
        result = Runner(resumed, optimizer, _small_loss, **options).fit(data, resume="latest")
    assert result.steps == 2 and optimizer.defaults["foreach"] is False
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume: ")]
    assert any("as the run that wrote the checkpoint did from global step 0" in m for m in said), said
    assert not any("settings replace this run's" in m for m in said), said
    plain, plain_optimizer = _small_stack()
    plain_optimizer.param_groups[0]["foreach"] = False
    for batch in data:
        plain_optimizer.zero_grad()
        _small_loss(plain, batch).backward()
        plain_optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), plain.parameters()))


def test_review34_a_resume_keeps_the_foreach_switch_and_says_why(tmp_path, caplog):
    """The checkpoint's groups hold foreach=False; the resumed run's default is switched too (a group added
    later steps per tensor, as in the run without the stop), and the warning names the cause, not "set
    them after resuming to change them", which sent the user back to the step that did not fit."""
    torch.manual_seed(1)
    data = [(torch.randn(4, 128), torch.randn(4, 128)) for _ in range(4)]
    options = dict(global_batch=4, micro_batch=4, progress=False, log_every=None, checkpoint_dir=tmp_path,
                   checkpoint_every=1)
    whole, whole_optimizer = _small_stack()
    with simulated_memory(SMALL_CAP):  # one budget per run: an earlier run's optimizer state is not this one's
        Runner(whole, whole_optimizer, _small_loss, **{**options, "checkpoint_dir": tmp_path / "whole"}).fit(data)
    first, optimizer = _small_stack()
    with simulated_memory(SMALL_CAP):
        Runner(first, optimizer, _small_loss, **options).fit(data, steps=2)
    model, optimizer = _small_stack()
    caplog.clear()
    with simulated_memory(SMALL_CAP):
        result = Runner(model, optimizer, _small_loss, **options).fit(data, resume="latest")
    assert [r["action"] for r in result.oom_recoveries] == ["same", "foreach"] and result.steps_this_run == 2
    assert optimizer.param_groups[0]["foreach"] is False and optimizer.defaults["foreach"] is False
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume: ")]
    assert any("foreach=False, as the run that wrote the checkpoint did from global step 0" in m for m in warned)
    assert not any("settings replace this run's" in m for m in warned), warned
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), whole.parameters()))


def test_review34_an_optimizer_step_that_fit_before_says_memory_is_held_since():
    """A squeeze held into the optimizer step gave up with "The optimizer step itself does not fit",
    though it had fit in every step before."""
    runner = _runner(FaultInjector((2, "optimizer"), times=None))
    with pytest.raises(StepOutOfMemoryError) as info:
        runner.fit(make_data(SAMPLES, GLOBAL))
    assert "It fit in the 2 steps this fit() trained before, so memory held since then" in str(info.value)
    assert "itself does not fit" not in str(info.value)
