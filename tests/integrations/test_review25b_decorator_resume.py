"""Review 25b: a decorated function that resumes from its own checkpoint (``accelerator.load_state``
at its top, ``accelerator.skip_first_batches(loader, steps_done)``) and saves while it trains
(``accelerator.save_state``) retried at another batch size skipped batches of the retry's size
while the checkpoint counted the failed attempt's: samples trained twice (or never), silently.
The retry is one warning naming the fix (``autobatch.integrations.decorator_resume``)."""

from __future__ import annotations

import warnings

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

from accelerator_cpu import accelerator  # noqa: E402,F401 - the fixture
from autobatch import find_executable_batch_size  # noqa: E402

DATA = torch.utils.data.TensorDataset(torch.arange(64.0).unsqueeze(1), torch.zeros(64, 1))
OWN = {method: accelerate.Accelerator.__dict__[method] for method in ("save_state", "load_state", "skip_first_batches")}


def resuming(accelerator, where, *, fail_above=12, skip=True, trained=None, load_from=None):
    """The resume pattern of the docs: load at the top, skip the done steps, save every 2 steps;
    an attempt above ``fail_above`` runs out of memory at its third step."""
    progress = {"steps": 0}

    @find_executable_batch_size(starting_batch_size=16, reduce_batch_size_fn=lambda: 12)
    def train(batch_size):
        accelerator.free_memory()  # the failed attempt's prepared objects: load_state matches the retry's
        model = torch.nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        model, optimizer = accelerator.prepare(model, optimizer)
        loader = accelerator.prepare(torch.utils.data.DataLoader(DATA, batch_size=batch_size))
        if progress["steps"]:
            accelerator.load_state(load_from or where)
            if skip:
                loader = accelerator.skip_first_batches(loader, progress["steps"])
        for step, (x, y) in enumerate(loader, start=progress["steps"] + 1):
            if trained is not None:
                trained.extend(int(v) for v in x.flatten())
            if batch_size > fail_above and step == 3:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            if step % 2 == 0:
                accelerator.save_state(where)
                progress["steps"] = step
        return batch_size

    return train


def test_a_retry_that_skips_a_failed_attempts_checkpoint_at_another_size_is_one_warning(accelerator, tmp_path):
    trained: list[int] = []
    with pytest.warns(RuntimeWarning, match=r"saved at batch 16.*skip_first_batches\(loader, 2\).*"
                                            r"samples 24-31 are trained twice.*Subset") as caught:
        assert resuming(accelerator, tmp_path / "ckpt", trained=trained)() == 12
    assert sorted(trained).count(24) == 2  # what the warning says: 24-31 twice
    assert len([w for w in caught if "skip_first_batches" in str(w.message)]) == 1


def test_the_warning_points_at_the_users_skip_line(accelerator, tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resuming(accelerator, tmp_path / "ckpt")()
    found = [w for w in caught if "skip_first_batches" in str(w.message)]
    assert len(found) == 1 and found[0].filename == __file__


def test_no_warning_without_a_skip_or_for_a_checkpoint_saved_before_the_call(accelerator, tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resuming(accelerator, tmp_path / "a", skip=False)() == 12  # e.g. a Subset instead
        assert resuming(accelerator, tmp_path / "b", fail_above=64)() == 16  # no retry
    assert not [w for w in caught if "skip_first_batches" in str(w.message)]


def test_a_checkpoint_from_before_the_call_loaded_by_the_retry_is_not_judged(accelerator, tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resuming(accelerator, tmp_path / "before", fail_above=64)() == 16  # an earlier call's checkpoint
        # the failed attempt saves elsewhere; the retry loads the earlier call's: its size is not known here
        assert resuming(accelerator, tmp_path / "mine", load_from=tmp_path / "before")() == 12
    assert not [w for w in caught if "skip_first_batches" in str(w.message)]


def test_the_accelerator_methods_are_put_back_after_the_call_even_when_it_raises(accelerator, tmp_path):
    seen = {}

    @find_executable_batch_size(starting_batch_size=4)
    def train(batch_size):
        seen.update({method: accelerate.Accelerator.__dict__[method] for method in OWN})
        raise ValueError("not out of memory")

    with pytest.raises(ValueError, match="not out of memory"):
        train()
    assert any(seen[method] is not OWN[method] for method in OWN)  # watched during the call
    assert {method: accelerate.Accelerator.__dict__[method] for method in OWN} == OWN
