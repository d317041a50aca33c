"""The order of an epoch as a user expects it, over real loader set-ups: an ``IterableDataset``
that shuffles by the epoch it is told (Hugging Face ``datasets``' ``IterableDataset.shuffle()``,
which Transformers' ``Trainer`` tells) drew the same order every epoch, the runner telling only
samplers; a persistent-worker ``IterableDataset``'s resume warning said the order was the same,
while the rest of a resumed epoch trained 17 of 48 samples twice; a ``ReduceLROnPlateau`` kept in
``extra_state``, as the runner advises, was warned about as a replaced learning rate on resume."""

from __future__ import annotations

import logging

import torch
from torch.utils.data import DataLoader, IterableDataset

from autobatch import Runner, inject_oom
from autobatch.training.checkpoints.resume_checks import warn_persistent_workers
from autobatch.training.epochs import set_epoch

SAMPLES, GLOBAL = 24, 4
X = torch.randn(SAMPLES, 3, generator=torch.Generator().manual_seed(0))


class EpochShuffled(IterableDataset):
    """A stream shuffled by a seed and the epoch it is told, as ``datasets``' streaming shuffle is."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        for i in torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(100 + self.epoch)).tolist():
            yield X[i], i


def run(epochs, *, steps=None, resume=None, checkpoint_dir=None):
    """The samples of each applied step, and the trained weights (an OOM replays step 2)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    steps_seen: list[list[int]] = []
    pending: list[int] = []

    def loss_fn(m, batch):
        pending.extend(batch[1].tolist())
        return m(batch[0]).square().mean()

    def on_step_end(info):
        steps_seen.append(pending[-info["samples"]:])
        pending.clear()

    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, global_batch=GLOBAL, micro_batch=GLOBAL,
                    progress=False, checkpoint_dir=checkpoint_dir)
    inject_oom(runner, at=[(2, "forward")], times=1)
    runner.fit(DataLoader(EpochShuffled(), batch_size=GLOBAL), epochs=epochs, steps=steps, resume=resume,
               on_step_end=on_step_end)
    return steps_seen, model.weight.detach().clone()


def test_an_iterable_dataset_is_told_each_epoch_and_resumes_in_its_order(tmp_path):
    seen, weight = run(3)
    per_epoch = SAMPLES // GLOBAL
    epochs = [sum(seen[e * per_epoch:(e + 1) * per_epoch], []) for e in range(3)]
    assert all(sorted(order) == list(range(SAMPLES)) for order in epochs)
    assert epochs[0] != epochs[1] != epochs[2]  # the same order every epoch before
    first, _ = run(3, steps=per_epoch + 2, checkpoint_dir=tmp_path)  # stopped inside the second epoch
    rest, resumed = run(3, resume=tmp_path)
    assert first + rest == seen
    torch.testing.assert_close(resumed, weight, rtol=0, atol=0)


def test_a_persistent_iterable_datasets_resume_warning_says_samples_may_repeat(caplog):
    loader = DataLoader(EpochShuffled(), batch_size=GLOBAL, num_workers=2, persistent_workers=True)  # never started
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        warn_persistent_workers(loader, position=3)
    assert "some of its samples twice and others not at all" in caplog.text
    assert "order is the same" not in caplog.text


def test_review39_a_persistent_loaders_resume_in_its_first_epoch_is_not_warned(caplog):
    """A resume in epoch 0 starts the new loader's workers from the uninterrupted run's base seed: its
    augmentations are the same to the run's end (checked by hand with workers), and the warning said
    they were not. A later epoch's resume is warned, as before."""
    loader = DataLoader(EpochShuffled(), batch_size=GLOBAL, num_workers=2, persistent_workers=True)  # never started
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        warn_persistent_workers(loader, position=3, epoch=0)
    assert "keeps its workers" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        warn_persistent_workers(loader, position=3, epoch=1)
    assert "keeps its workers" in caplog.text


def test_a_plateau_scheduler_in_extra_state_resumes_without_a_replaced_rate_warning(tmp_path, caplog):
    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", patience=0, factor=0.5)  # a falling loss lowers it
        runner = Runner(model, optimizer, lambda m, b: m(b[0]).square().mean(), global_batch=GLOBAL, micro_batch=GLOBAL,
                        progress=False, checkpoint_dir=tmp_path, extra_state={"plateau": plateau})
        return runner, plateau, optimizer

    data = [(X[i:i + GLOBAL], torch.arange(GLOBAL)) for i in range(0, SAMPLES, GLOBAL)]
    runner, plateau, _ = build()
    runner.fit(data, steps=3, on_step_end=lambda info: plateau.step(info["loss"]))
    runner, plateau, optimizer = build()
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        runner.fit(data, steps=4, resume=tmp_path, on_step_end=lambda info: plateau.step(info["loss"]))
    assert "settings replace this run's" not in caplog.text
    assert optimizer.param_groups[0]["lr"] < 0.1  # the plateau's lowered rate, resumed


class SharedEpochShuffled(EpochShuffled):
    """The same stream, its epoch in shared memory changed in place: persistent workers see it."""

    def __init__(self) -> None:
        self.epoch = torch.zeros((), dtype=torch.long).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)


def test_review37_set_epoch_that_persistent_workers_never_see_is_warned(caplog):
    """``set_epoch`` on a persistent-worker loader's dataset that sets ``self.epoch = epoch`` anew
    never reaches the workers' copies: an epoch-seeded shuffle repeated the first epoch's order all
    run (3 epochs of 24 samples, 2 workers: every epoch the same batches), and a resume's fresh
    workers drew another, without a word. Checked in-process: no worker is started."""
    loaders = {name: DataLoader(ds, batch_size=GLOBAL, num_workers=workers, persistent_workers=workers > 0)
               for name, ds, workers in [("plain", EpochShuffled(), 2), ("shared", SharedEpochShuffled(), 2),
                                         ("no workers", EpochShuffled(), 0)]}
    for name, loader in loaders.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="autobatch"):
            for epoch in range(3):
                set_epoch(loader, epoch)
        assert loader.dataset.epoch == 2
        expected = 1 if name == "plain" else 0  # once per loader; a shared epoch reaches the workers
        assert caplog.text.count("never see") == expected, name
        if expected:
            assert "sets self.epoch anew" in caplog.text and "share_memory_()" in caplog.text
