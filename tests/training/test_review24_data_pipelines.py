"""Data pipelines people feed the runner, each with an OOM forced mid-run and a resume from a
mid-epoch checkpoint: every sample trains exactly once per epoch (counted by id), the replay
ends with the uninjected run's weights, and the resume continues exactly. And a resume with
another ``global_batch`` whose loader kept the old ``batch_size``: its position, counted in the
new batches, skipped the rest of the epoch (16 samples trained of 22, all 22 skipped) with two
warnings naming neither cause nor loss; one error naming the loader's batch size instead."""

from __future__ import annotations

import collections
import random
from collections import UserDict

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from autobatch import Runner
from autobatch.training.oom.faults import FaultInjector

N = 22  # samples: batches of 4 leave a short last one of 2
LENGTHS = [1 + (i * 7) % 5 for i in range(N)]


def _features(i: int) -> torch.Tensor:
    return torch.arange(4, dtype=torch.float64) * 0.1 + i * 0.01


class Samples(Dataset):
    """``(tensor, int label)`` items; a list of indices (a sampler of index lists) is a padded batch."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, index):
        if isinstance(index, list):
            return _padded([self[i] for i in index])
        return torch.stack([_features(index)] * LENGTHS[index]), index


class Stream(IterableDataset):
    def __iter__(self):
        for i in range(N):
            yield _features(i), i


def _padded(items):
    """Pad to the batch's longest sequence; a dict with a mask, ids as strings, a nested dict,
    a 0-dim per-batch temperature and a None field."""
    longest = max(x.shape[0] for x, _ in items)
    x, mask = torch.zeros(len(items), longest, 4, dtype=torch.float64), torch.zeros(len(items), longest, dtype=torch.float64)
    for row, (sequence, _) in enumerate(items):
        x[row, :len(sequence)], mask[row, :len(sequence)] = sequence, 1
    return {"inputs": {"x": x, "mask": mask}, "ids": [str(i) for _, i in items], "temperature": torch.tensor(1.0),
            "none": None}


class LengthGroups(torch.utils.data.Sampler):
    """Index lists of similar lengths, shuffled by its own ``random.Random``."""

    def __init__(self) -> None:
        self.rng = random.Random(0)

    def __iter__(self):
        order = sorted(range(N), key=LENGTHS.__getitem__)
        groups = [order[k:k + 4] for k in range(0, N, 4)]
        self.rng.shuffle(groups)
        return iter(groups)

    def __len__(self) -> int:
        return (N + 3) // 4


def _generator():
    for start in range(0, N, 4):
        ids = list(range(start, min(start + 4, N)))
        yield torch.stack([_features(i) for i in ids]), torch.tensor(ids)


def _pairs(batch):
    return batch[0], batch[1].tolist()


def _from_padded(batch):
    inputs = batch["inputs"]
    mean = (inputs["x"] * inputs["mask"][..., None]).sum(1) / inputs["mask"].sum(1, keepdim=True)
    assert batch["none"] is None and batch["temperature"].dim() == 0
    return mean, [int(i) for i in batch["ids"]]


def _user_dict(items):
    return UserDict({"x": torch.stack([_features(i) for _, i in items]), "ids": torch.tensor([i for _, i in items])})


PIPELINES = {
    "iterable-without-len": (lambda: DataLoader(Stream(), batch_size=4, num_workers=0), _pairs, 2),
    "generator": (_generator, _pairs, 1),
    "padded-length-groups": (lambda: DataLoader(Samples(), batch_size=None, sampler=LengthGroups()), _from_padded, 2),
    "user-dict-pinned": (lambda: DataLoader(Stream(), batch_size=4, collate_fn=_user_dict, pin_memory=True),
                         lambda b: (b["x"], b["ids"].tolist()), 2),
}


def _runner(read, checkpoint_dir=None, faults=None, global_batch=4):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    calls, trained = [], []

    def loss_fn(model, batch):
        x, ids = read(batch)
        calls.append(ids)
        return ((model(x).squeeze(-1) - torch.tensor(ids, dtype=torch.float64) * 0.01) ** 2).mean()

    def on_step_end(info):  # the applied attempt's micro-batches are the last info["accumulation"] calls
        trained.extend(i for ids in calls[-info["accumulation"]:] for i in ids)
        calls.clear()

    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, global_batch=global_batch,
                    micro_batch=global_batch, device="cpu", progress=False, faults=faults, checkpoint_dir=checkpoint_dir)
    return runner, model, trained, on_step_end


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", list(PIPELINES))
def test_every_sample_once_per_epoch_through_an_oom_and_a_mid_epoch_resume(name, tmp_path):
    make, read, epochs = PIPELINES[name]
    runner, model, _, _ = _runner(read)
    runner.fit(make(), epochs=epochs)
    expected = model.weight.detach().clone()

    runner, model, trained, hook = _runner(read, faults=FaultInjector([(1, "backward"), (3, "forward")]))
    result = runner.fit(make(), epochs=epochs, on_step_end=hook)
    assert len(result.oom_recoveries) == 2
    assert collections.Counter(trained) == {i: epochs for i in range(N)}
    torch.testing.assert_close(model.weight, expected, rtol=1e-10, atol=1e-12)

    runner, _, first, hook = _runner(read, checkpoint_dir=tmp_path)
    runner.fit(make(), steps=3, on_step_end=hook)  # mid-epoch: 12 of 22 samples
    runner, model, rest, hook = _runner(read, checkpoint_dir=tmp_path)
    runner.fit(make(), epochs=epochs, resume=tmp_path, on_step_end=hook)
    assert collections.Counter(first + rest) == {i: epochs for i in range(N)}
    torch.testing.assert_close(model.weight, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.filterwarnings("ignore")
def test_a_resume_with_another_global_batch_over_the_old_loader_is_one_error(tmp_path):
    runner, _, _, _ = _runner(_pairs, checkpoint_dir=tmp_path)
    runner.fit(DataLoader(Stream(), batch_size=4), steps=4)  # 16 of the epoch's 22 samples
    runner, _, trained, hook = _runner(_pairs, checkpoint_dir=tmp_path, global_batch=2)
    with pytest.raises(ValueError, match=r"trained 16 samples of epoch 1, 8 batches of this run's global_batch, but "
                                         r"the data's first 6 batches hold 22 \(4, 4, 4, 4, \.\.\.\).* would skip samples\. "
                                         r"Build the data with batch_size=global_batch"):
        runner.fit(DataLoader(Stream(), batch_size=4), epochs=1, resume=tmp_path, on_step_end=hook)
    assert trained == []
    runner, _, trained, hook = _runner(_pairs, checkpoint_dir=tmp_path, global_batch=2)
    runner.fit(DataLoader(Stream(), batch_size=2), epochs=1, resume=tmp_path, on_step_end=hook)
    assert sorted(trained) == list(range(16, N))  # rebuilt alike: the rest of the epoch, once


@pytest.mark.filterwarnings("ignore")
def test_a_checkpoint_older_than_its_sample_count_resumes_unchecked(tmp_path):
    """A checkpoint written before ``epoch_samples`` was recorded, by a run whose batches were
    not all ``global_batch`` long (groups of 4 and 2): position times global batch is not its
    count, so the resume is not refused by a count it never wrote."""
    groups = [g for k in range(0, N, 6) for g in (list(range(k, min(k + 4, N))), list(range(k + 4, min(k + 6, N)))) if g]

    def loader():
        return DataLoader(Samples(), batch_size=None, sampler=groups)

    runner, _, first, hook = _runner(_from_padded, checkpoint_dir=tmp_path)
    runner.fit(loader(), steps=3, on_step_end=hook)  # 4 + 2 + 4 samples, at position 3 (12 by the old count)
    path = tmp_path / "last.pt"
    state = torch.load(path, weights_only=True)
    del state["epoch_samples"]
    torch.save(state, path)
    runner, _, rest, hook = _runner(_from_padded, checkpoint_dir=tmp_path)
    runner.fit(loader(), epochs=1, resume=tmp_path, on_step_end=hook)
    assert sorted(first + rest) == list(range(N))
