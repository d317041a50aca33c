"""A run ended by an error its data raises (a corrupt sample read by the loader) keeps the steps
it trained: they are saved to ``checkpoint_dir`` before the error is raised as itself, with a
note naming the file. Before, only an OOM give-up or used-up data saved, and a corrupt sample at
step 6 of a run without ``checkpoint_every`` lost all six steps. An error inside a step (a
``loss_fn``'s) saves nothing: it may be the user's guard against weights gone bad, and a save
would write over the last good checkpoint."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import autobatch


class Corrupt(torch.utils.data.Dataset):
    """40 samples, of which ``bad`` raises as a corrupt file does when read."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int):
        if index == self.bad:
            raise ValueError(f"corrupt sample {index}")
        gen = torch.Generator().manual_seed(index)
        return torch.randn(4, generator=gen), torch.randn(1, generator=gen)


def _loss(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def _runner(tmp_path, loss_fn=_loss, **options) -> autobatch.Runner:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return autobatch.Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, micro_batch=4,
                            global_batch=4, checkpoint_dir=tmp_path, device="cpu", **options)


def test_a_corrupt_sample_mid_run_saves_the_steps_trained_and_raises_itself(tmp_path):
    runner = _runner(tmp_path)
    with pytest.raises(ValueError, match="corrupt sample 25") as caught:
        runner.fit(torch.utils.data.DataLoader(Corrupt(bad=25), batch_size=4), epochs=1)
    assert any("the 6 steps trained are saved in" in note for note in caught.value.__notes__)
    # the same data, mended, resumes at the batch that failed and ends where an unbroken run ends
    resumed = _runner(tmp_path / "other")
    resumed.fit(torch.utils.data.DataLoader(Corrupt(bad=-1), batch_size=4), epochs=1, resume=tmp_path / "last.pt")
    whole = _runner(tmp_path / "whole")
    whole.fit(torch.utils.data.DataLoader(Corrupt(bad=-1), batch_size=4), epochs=1)
    assert resumed.step == whole.step == 10
    torch.testing.assert_close(resumed.model.weight, whole.model.weight)


def test_a_loss_error_inside_a_step_keeps_the_last_checkpoint_as_it_was(tmp_path):
    calls = []

    def loss_fn(model, batch):
        calls.append(1)
        if len(calls) == 5:
            raise FloatingPointError("loss is nan: stopping before the weights go bad")
        return _loss(model, batch)

    runner = _runner(tmp_path, loss_fn, checkpoint_every=3)
    with pytest.raises(FloatingPointError, match="loss is nan") as caught:
        runner.fit(torch.utils.data.DataLoader(Corrupt(bad=-1), batch_size=4), epochs=1)
    assert not getattr(caught.value, "__notes__", None)  # raised as the user raised it
    assert torch.load(tmp_path / "last.pt", weights_only=True)["step"] == 3  # step 3's, as saved


def test_a_one_sample_last_batch_out_of_memory_is_named_in_plain_words(tmp_path):
    """The give-up read "hold at most 1 samples: no micro-batch min_micro_batch=1 allows cuts them
    smaller"; the steps before it are still saved."""
    from autobatch.errors import StepOutOfMemoryError
    from autobatch.training.oom.faults import FaultInjector

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    runner = autobatch.Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, global_batch=4,
                              micro_batch=4, device="cpu", checkpoint_dir=tmp_path,
                              faults=FaultInjector([(2, "backward")], times=None))
    data = [(torch.randn(n, 4), torch.randn(n, 1)) for n in (4, 4, 1)]
    with pytest.raises(StepOutOfMemoryError, match=r"micro-batch 4, whose pieces of this batch hold at most 1 sample, "
                                                   r"and no smaller piece is one min_micro_batch=1 allows") as caught:
        runner.fit(data, epochs=1)
    assert any("the 2 steps trained are saved in" in note for note in caught.value.__notes__)
