"""What a resume takes from its checkpoint, and what from the resumed run's own settings.

* Grow-back: the resumed Runner's ``grow_after`` and ``max_micro_batch`` win; what the first run
  learned from its OOMs (the back-off, the streak) carries over.
* A checkpoint written at an epoch's last step (the epoch not yet counted) resumes with another
  ``global_batch`` as the start of the next epoch; a position that does not convert names the
  samples really trained.
* The scheduler's class is checked as the optimizer's is: another one is one ``CheckpointError``
  naming both, before anything is loaded; a state it cannot load is the same error.
* A ``DataLoader(persistent_workers=True)`` resume is warned about (its workers' random state is
  in no checkpoint).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from autobatch import CheckpointError, Runner
from autobatch.training.oom.growth import GrowBack


def mse(model, batch):
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def batches(samples: int, size: int):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 6, generator=generator, dtype=torch.float64)
    y = torch.randn(samples, 1, generator=generator, dtype=torch.float64)
    return [(x[i : i + size], y[i : i + size]) for i in range(0, samples, size)]


def runner(loss_fn=mse, scheduler=None, **options) -> Runner:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    options = {"global_batch": 16, "progress": False, **options}
    return Runner(model, optimizer, loss_fn, scheduler=scheduler(optimizer) if scheduler else None, **options)


def small_only(model, batch):
    """A device on which micro-batches above 8 never fit."""
    if batch[0].shape[0] > 8:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
    return mse(model, batch)


# -- grow-back settings ----------------------------------------------------------------------------
def failed_tries(result) -> list[int]:
    return [attempt["step"] for attempt in result.grow_attempts if not attempt["held"]]


def test_a_resume_with_grow_back_on_grows_as_a_fresh_run_after_one_with_it_off(tmp_path):
    """The checkpoint of a run with grow-back off held wait=0: resumed with grow_after=10, every
    step tried to grow (25 failed tries in 25 steps), and the doubled wait stayed 0."""
    data = batches(160, 16)
    runner(small_only, micro_batch=8, max_micro_batch=16, grow_after=None, checkpoint_dir=tmp_path).fit(data, steps=5)
    resumed = runner(small_only, micro_batch=8, max_micro_batch=16, grow_after=10, checkpoint_dir=tmp_path)
    result = resumed.fit(data, epochs=3, resume=tmp_path)
    fresh = runner(small_only, micro_batch=8, max_micro_batch=16, grow_after=10).fit(data, epochs=3)
    assert failed_tries(result) == failed_tries(fresh) == [10]
    assert resumed.growth.wait == 20


def test_a_resume_takes_max_micro_batch_from_its_runner(tmp_path):
    data = batches(160, 16)
    runner(micro_batch=4, grow_after=2, checkpoint_dir=tmp_path).fit(data, steps=1)  # ceiling 4: its micro-batch
    resumed = runner(micro_batch=4, max_micro_batch=16, grow_after=2)
    result = resumed.fit(data, epochs=2, resume=tmp_path)
    assert resumed.growth.ceiling == 16 and result.micro_batch == 16


def test_a_resume_keeps_the_back_off_learned_from_failed_grow_tries(tmp_path):
    """Two failed tries doubled the wait twice (2 -> 8): a resume with grow_after=3 waits 3 x 4."""
    data = batches(160, 16)
    first = runner(small_only, micro_batch=8, max_micro_batch=16, grow_after=2, checkpoint_dir=tmp_path)
    assert len(failed_tries(first.fit(data, steps=12))) == 2 and first.growth.wait == 8
    resumed = runner(small_only, micro_batch=8, max_micro_batch=16, grow_after=3)
    resumed.fit(data, steps=13, resume=tmp_path)
    assert resumed.growth.wait == 12 and resumed.growth.streak == first.growth.streak + 1


def test_the_grow_back_state_machine_loads_learned_state_under_its_own_settings():
    saved = GrowBack(4, 32).state_dict() | {"wait": 16, "streak": 3, "ceiling": 32}  # two failed tries
    mine = GrowBack(None, 8)
    mine.load_state_dict(saved)
    assert (mine.wait, mine.ceiling, mine.streak) == (0, 8, 3)
    planned = GrowBack(5, 64, configured=False)  # a planned run resumed: the checkpoint's probe maximum
    planned.load_state_dict(saved, limit=16)
    assert (planned.wait, planned.ceiling) == (20, 16)
    older = {key: value for key, value in saved.items() if key != "grow_after"}  # an earlier version's checkpoint
    for grow_after, wait in ((4, 16), (8, 16), (5, 5)):
        growth = GrowBack(grow_after, 8)
        growth.load_state_dict(older)
        assert growth.wait == wait


# -- a checkpoint at an epoch's last step, resumed with another global batch -------------------------
class Stop(Exception):
    pass


def loader(global_batch: int, samples: int = 84) -> DataLoader:
    x = torch.randn(samples, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    dataset = TensorDataset(x, x.sum(1, keepdim=True))
    return DataLoader(dataset, batch_size=global_batch, shuffle=True, generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("samples, new_batch", [(84, 32), (80, 32), (84, 28)])
def test_a_checkpoint_at_an_epochs_last_step_resumes_with_another_global_batch(tmp_path, samples, new_batch):
    """A periodic checkpoint at the epoch's last step held position 6 of 6 of an epoch not yet
    counted: another global batch was refused, the message counting 96 samples for an 84-sample
    epoch. It is now the next epoch's start, as the checkpoint of a run stopped there by
    ``steps``: the same file but for its counters, resumed in the seeded loader's uninterrupted
    order whether the epoch's last batch was short (84) or whole (80)."""
    per_epoch = -(-samples // 16)
    periodic, ended = tmp_path / "periodic", tmp_path / "ended"
    holder = []

    def stopped_in_the_next_epoch(model, batch):
        if holder[0].step == per_epoch + 1:
            raise Stop()
        return mse(model, batch)
    holder.append(runner(stopped_in_the_next_epoch, micro_batch=8, checkpoint_dir=periodic, checkpoint_every=per_epoch))
    with pytest.raises(Stop):
        holder[0].fit(loader(16, samples), epochs=3)
    runner(micro_batch=8, checkpoint_dir=ended).fit(loader(16, samples), steps=per_epoch)
    saved = torch.load(periodic / "last.pt", weights_only=True)
    assert (saved["step"], saved["epoch"], saved["position"]) == (per_epoch, 1, 0)
    finals = []
    for checkpoint in (periodic, ended):
        resumed = runner(micro_batch=8, global_batch=new_batch)
        result = resumed.fit(loader(new_batch, samples), epochs=3, resume=checkpoint)
        assert result.epochs == 3 and result.samples == 2 * samples
        finals.append([p.detach().clone() for p in resumed.model.parameters()])
    for mine, theirs in zip(*finals):
        assert torch.equal(mine, theirs)


def test_a_checkpoint_at_an_epochs_last_step_resumes_the_uninterrupted_order(tmp_path):
    """Same global batch, seeded loader with a whole last batch: bit-equal to the run that went on."""
    reference = runner(micro_batch=8)
    reference.fit(loader(16, 80), epochs=3)
    holder = []

    def stopped_in_the_next_epoch(model, batch):
        if holder[0].step == 7:
            raise Stop()
        return mse(model, batch)
    holder.append(runner(stopped_in_the_next_epoch, micro_batch=8, checkpoint_dir=tmp_path, checkpoint_every=5))
    with pytest.raises(Stop):
        holder[0].fit(loader(16, 80), epochs=3)
    resumed = runner(micro_batch=8)
    assert resumed.fit(loader(16, 80), epochs=3, resume=tmp_path).steps_this_run == 10
    for mine, theirs in zip(resumed.model.parameters(), reference.model.parameters()):
        assert torch.equal(mine, theirs)


def test_a_position_that_does_not_convert_counts_the_samples_trained(tmp_path):
    """Batches of 16, 16, 4 (short), 16: stopped after 3, the epoch is 36 samples in, not 48."""
    data = batches(36, 16) + batches(16, 16)
    runner(micro_batch=8, checkpoint_dir=tmp_path).fit(data, steps=3)
    with pytest.raises(CheckpointError, match=r"3 batches of 16 into its epoch \(36 samples\).*global_batch=32"):
        runner(micro_batch=8, global_batch=32).fit(data, epochs=1, resume=tmp_path)
    resumed = runner(micro_batch=8, global_batch=12)
    assert resumed.fit(batches(52, 12), epochs=1, resume=tmp_path).steps == 3 + 2  # 36 = 3 x 12 trained


# -- the scheduler's class -------------------------------------------------------------------------
SCHEDULERS = {
    "StepLR": lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 3, 0.5),
    "OneCycleLR": lambda optimizer: torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=100),
}


@pytest.mark.parametrize("old, new", [("StepLR", "OneCycleLR"), ("OneCycleLR", "StepLR")])
def test_a_checkpoint_of_another_scheduler_is_one_clear_error(tmp_path, old, new):
    """StepLR into OneCycleLR raised a bare KeyError: 'max_lr' a step later; OneCycleLR into
    StepLR trained on with OneCycleLR's attributes. Now refused before anything is loaded."""
    data = batches(64, 16)
    runner(micro_batch=8, scheduler=SCHEDULERS[old], checkpoint_dir=tmp_path).fit(data, steps=2)
    resumed = runner(micro_batch=8, scheduler=SCHEDULERS[new])
    before = [p.detach().clone() for p in resumed.model.parameters()]
    with pytest.raises(CheckpointError, match=f"written with scheduler {old} and this run's is {new}; resume with {old}"):
        resumed.fit(data, steps=4, resume=tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(before, resumed.model.parameters()))


class Picky(torch.optim.lr_scheduler.StepLR):
    """A scheduler whose state needs a key the checkpoint lacks."""

    def load_state_dict(self, state_dict):
        self.milestone = state_dict["milestone"]
        super().load_state_dict(state_dict)


def test_a_scheduler_state_that_does_not_load_is_a_checkpoint_error(tmp_path):
    data = batches(64, 16)
    scheduler = lambda optimizer: Picky(optimizer, 3, 0.5)  # noqa: E731
    runner(micro_batch=8, scheduler=scheduler, checkpoint_dir=tmp_path).fit(data, steps=2)
    with pytest.raises(CheckpointError, match=r"scheduler state does not fit this run's Picky \(KeyError: 'milestone'\)"):
        runner(micro_batch=8, scheduler=scheduler).fit(data, steps=4, resume=tmp_path)


def test_a_scheduler_added_or_dropped_on_resume_is_warned_about(tmp_path, caplog):
    data = batches(64, 16)
    runner(micro_batch=8, scheduler=SCHEDULERS["StepLR"], checkpoint_dir=tmp_path).fit(data, steps=2)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        runner(micro_batch=8).fit(data, steps=4, resume=tmp_path)
    assert "the checkpoint's run had scheduler StepLR and this run has none" in caplog.text


def test_review38_a_scheduler_setting_the_checkpoint_replaces_is_warned_once(tmp_path, caplog):
    """``CosineAnnealingLR(T_max=...)`` given another value on resume ran the checkpoint's without a
    word (torch's load_state_dict sets it): warned once, naming both values; what is loaded is
    unchanged, and a resume with the same settings (its counters moved) says nothing."""
    from omegaconf import OmegaConf

    from autobatch.cli.log_advice import advice_in_logs

    data = batches(64, 16)
    cosine = lambda t_max: lambda optimizer: torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=t_max)  # noqa: E731
    runner(micro_batch=8, scheduler=cosine(10), checkpoint_dir=tmp_path).fit(data, steps=2)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        runner(micro_batch=8, scheduler=cosine(10)).fit(data, steps=3, resume=tmp_path)
        assert "scheduler settings" not in caplog.text
        resumed = runner(micro_batch=8, scheduler=cosine(50))
        resumed.fit(data, steps=3, resume=tmp_path)
    warned = [r.getMessage() for r in caplog.records if "scheduler settings" in r.getMessage()]
    assert len(warned) == 1 and "replace this run's (CosineAnnealingLR.load_state_dict sets them), and the run goes on " \
        "with the checkpoint's: T_max 10 (this run: 50); to change them, set them on runner.scheduler" in warned[0]
    assert resumed.scheduler.T_max == 10  # loaded as before
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="autobatch"), advice_in_logs(OmegaConf.create({})):
        runner(micro_batch=8, scheduler=cosine(50)).fit(data, steps=3, resume=tmp_path)
    assert "T_max 10 (this run: 50); start afresh without train.resume to train with this run's" in caplog.text


# -- persistent workers ----------------------------------------------------------------------------
class Loader(list):
    """Stands for a DataLoader (no workers started): its worker settings and batches."""

    def __init__(self, items, persistent_workers):
        super().__init__(items)
        self.num_workers, self.persistent_workers = 2, persistent_workers


@pytest.mark.parametrize("persistent", [True, False])
def test_a_resume_with_persistent_workers_is_warned_about(tmp_path, caplog, persistent):
    data = batches(64, 16)
    runner(micro_batch=8, checkpoint_dir=tmp_path).fit(Loader(data, persistent), steps=6, epochs=2)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        runner(micro_batch=8).fit(Loader(data, persistent), epochs=2, resume=tmp_path)
    assert ("persistent_workers=True" in caplog.text) is persistent


def test_a_resume_at_another_precision_is_warned_about(tmp_path, caplog):
    """The checkpoint records its precision: a run resumed under another autocast dtype (its
    micro-batch sized for the old one) says so, where it used to change silently."""
    import autobatch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    data = [(torch.randn(8, 8), torch.randint(0, 2, (8,))) for _ in range(4)]
    loss = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731

    def runner(dtype):
        return autobatch.Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss, global_batch=8,
                                micro_batch=8, autocast_dtype=dtype, checkpoint_dir=tmp_path)

    runner("bfloat16").fit(data, steps=2)
    with caplog.at_level("WARNING", logger="autobatch"):
        runner("bfloat16").fit(data, steps=3, resume=tmp_path)
        assert "precision" not in caplog.text
        runner(None).fit(data, steps=4, resume=tmp_path)
    assert "trained with autocast bfloat16 and this run with None" in caplog.text


# -- a OneCycleLR shorter than the fit (review 38) -----------------------------------------------
def one_cycle(total_steps):
    return lambda optimizer: torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=total_steps)


def test_review38_resume_past_the_checkpoints_one_cycle_is_refused_before_a_step(tmp_path):
    """Epochs raised on a resume, the OneCycleLR built for the new length: the checkpoint's
    total_steps replaced it, and the run trained to its end, then crashed with torch's 'Tried to
    step 5 times. The specified number of total steps is 4'. Now one error before any step."""
    data = batches(64, 16)
    runner(micro_batch=8, scheduler=one_cycle(4), checkpoint_dir=tmp_path).fit(data, epochs=1)
    resumed = runner(micro_batch=8, scheduler=one_cycle(8))
    with pytest.raises(ValueError, match=r"fit\(epochs=2\) trains to step 8, but the scheduler OneCycleLR has "
                       r"total_steps=4 \(the checkpoint's.*start afresh with OneCycleLR\(total_steps=8\)"):
        resumed.fit(data, epochs=2, resume=tmp_path)
    assert resumed.step == 4 and resumed.result.steps_this_run == 0


def test_review38_a_one_cycle_shorter_than_a_fresh_fit_is_refused_before_a_step():
    """Without a resume it trained the cycle's 4 steps, then crashed at the fifth."""
    fresh = runner(micro_batch=8, scheduler=one_cycle(4))
    before = [p.detach().clone() for p in fresh.model.parameters()]
    with pytest.raises(ValueError, match=r"fit\(steps=6\) trains to step 6, .*after step 4: fit\(steps=4\) ends"):
        fresh.fit(batches(64, 16), steps=6)
    assert fresh.step == 0 and all(torch.equal(a, b) for a, b in zip(before, fresh.model.parameters()))
    fresh.fit(batches(64, 16), epochs=1)  # the cycle's length trains
    assert fresh.step == 4


# -- schedulers inside SequentialLR / ChainedScheduler (review 39) ---------------------------------
def sequential(*make, milestones):
    return lambda optimizer: torch.optim.lr_scheduler.SequentialLR(optimizer, [m(optimizer) for m in make], milestones)


def test_review39_a_one_cycle_inside_sequential_or_chained_lr_is_refused_before_a_step():
    """A OneCycleLR inside SequentialLR or ChainedScheduler was not looked at: the fit trained to the
    cycle's end, then crashed with torch's 'Tried to step 5 times'. After milestone 3 a
    total_steps=4 cycle lasts to step 7; lambdas and multipliers, which run on, are left alone."""
    lr = torch.optim.lr_scheduler
    warm = lambda optimizer: lr.LinearLR(optimizer, 0.1, total_iters=3)  # noqa: E731
    in_sequence = sequential(warm, one_cycle(4), milestones=[3])
    runner(micro_batch=8, scheduler=in_sequence).fit(batches(112, 16), steps=7)  # the cycle's length trains
    refused = runner(micro_batch=8, scheduler=in_sequence)
    with pytest.raises(ValueError, match=r"fit\(steps=8\) trains to step 8, but the scheduler OneCycleLR \(SequentialLR's "
                       r"scheduler 1 after its milestone 3\) has total_steps=4 .*after step 7.*OneCycleLR\(total_steps=5\)"):
        refused.fit(batches(128, 16), steps=8)
    assert refused.step == 0
    chained = lambda optimizer: lr.ChainedScheduler([warm(optimizer), one_cycle(4)(optimizer)])  # noqa: E731
    with pytest.raises(ValueError, match=r"OneCycleLR \(ChainedScheduler's scheduler 1\) has total_steps=4 .*after step 4"):
        runner(micro_batch=8, scheduler=chained).fit(batches(128, 16), steps=5)
    running_on = sequential(lambda o: lr.LambdaLR(o, lambda s: 1.0), lambda o: lr.MultiplicativeLR(o, lambda s: 0.99),
                            milestones=[1])
    assert runner(micro_batch=8, scheduler=running_on).fit(batches(128, 16), steps=8).steps_this_run == 8


def test_review39_a_setting_inside_sequential_lr_the_checkpoint_replaces_is_warned(tmp_path, caplog):
    """SequentialLR's load_state_dict loads its schedulers' states and its milestones: a T_max (or
    milestone) given anew on resume was replaced without a word. Now named, with the scheduler."""
    lr = torch.optim.lr_scheduler
    data = batches(64, 16)

    def schedule(t_max, milestone):
        return sequential(lambda o: lr.LinearLR(o, 0.1, total_iters=2),
                          lambda o: lr.CosineAnnealingLR(o, T_max=t_max), milestones=[milestone])

    running_on = sequential(lambda o: lr.LambdaLR(o, lambda s: 1.0), lambda o: lr.MultiplicativeLR(o, lambda s: 0.99),
                            milestones=[1])
    runner(micro_batch=8, scheduler=schedule(10, 2), checkpoint_dir=tmp_path).fit(data, steps=3)
    runner(micro_batch=8, scheduler=running_on, checkpoint_dir=tmp_path / "lambdas").fit(data, steps=3)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        runner(micro_batch=8, scheduler=schedule(10, 2)).fit(data, steps=4, resume=tmp_path)
        runner(micro_batch=8, scheduler=running_on).fit(data, steps=4, resume=tmp_path / "lambdas")
        assert "scheduler settings" not in caplog.text
        resumed = runner(micro_batch=8, scheduler=schedule(50, 3))
        resumed.fit(data, steps=4, resume=tmp_path)
    assert "(SequentialLR.load_state_dict sets them), and the run goes on with the checkpoint's: milestones [2] (this " \
        "run: [3]), _schedulers[1] (CosineAnnealingLR) T_max 10 (this run: 50); to change them" in caplog.text
    assert resumed.scheduler._schedulers[1].T_max == 10  # loaded as before


def test_review39_another_scheduler_inside_sequential_or_chained_lr_is_refused_before_loading(tmp_path):
    """Only the outer class was compared: a StepLR's state loaded into a OneCycleLR inside the same
    SequentialLR without a word, then raised KeyError: 'max_lr' at the first step after the milestone.
    Now one CheckpointError naming both classes and the place, before anything loads; the same inside a
    ChainedScheduler, nested, and for another number of schedulers."""
    lr = torch.optim.lr_scheduler
    data = batches(128, 16)
    warm, step = (lambda o: lr.LinearLR(o, 0.1, total_iters=2)), (lambda o: lr.StepLR(o, step_size=2))  # noqa: E731
    cycle = lambda o: lr.OneCycleLR(o, max_lr=0.1, total_steps=20)  # noqa: E731
    runner(micro_batch=8, scheduler=sequential(warm, step, milestones=[2]), checkpoint_dir=tmp_path / "seq").fit(data, steps=1)
    refused = runner(micro_batch=8, scheduler=sequential(warm, cycle, milestones=[2]))
    before = [p.detach().clone() for p in refused.model.parameters()]
    with pytest.raises(CheckpointError, match=r"written with scheduler StepLR at _schedulers\[1\] \(inside SequentialLR\) "
                       r"and this run's is OneCycleLR; resume with StepLR there, or start afresh"):
        refused.fit(data, steps=4, resume=tmp_path / "seq")
    assert all(torch.equal(a, b) for a, b in zip(before, refused.model.parameters()))
    with pytest.raises(CheckpointError, match=r"its SequentialLR holds 2 schedulers \(LinearLR, StepLR\) and this run's 3"):
        runner(micro_batch=8, scheduler=sequential(warm, step, step, milestones=[2, 3])).fit(data, steps=4, resume=tmp_path / "seq")
    nested = lambda inner: lambda o: lr.ChainedScheduler([warm(o), sequential(warm, inner, milestones=[2])(o)])  # noqa: E731
    runner(micro_batch=8, scheduler=nested(step), checkpoint_dir=tmp_path / "chained").fit(data, steps=1)
    with pytest.raises(CheckpointError, match=r"StepLR at _schedulers\[1\]._schedulers\[1\] \(inside ChainedScheduler\) "
                       r"and this run's is OneCycleLR"):
        runner(micro_batch=8, scheduler=nested(cycle)).fit(data, steps=4, resume=tmp_path / "chained")
    runner(micro_batch=8, scheduler=nested(step)).fit(data, steps=4, resume=tmp_path / "chained")  # the same: resumes
