"""Review 26: ``accelerate.skip_first_batches(loader, n)``, the module-level function (imported by
name before the call, as Accelerate's docs and Transformers do), in a retry that resumes from a
checkpoint a failed attempt saved at another batch size, skipped batches of the retry's size,
silently: only the ``Accelerator`` method was watched (``autobatch.integrations.decorator_resume``)."""

from __future__ import annotations

import warnings

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

from accelerate import skip_first_batches  # noqa: E402 - bound before any decorated call, as users do
from accelerator_cpu import accelerator  # noqa: E402,F401 - the fixture
from autobatch import find_executable_batch_size  # noqa: E402

DATA = torch.utils.data.TensorDataset(torch.arange(64.0).unsqueeze(1), torch.zeros(64, 1))


def resuming(accelerator, where, trained, *, skip=skip_first_batches, prepared=True):
    """Load at the top, skip the done steps with ``skip``, save every 2 steps; batch 16 runs out
    of memory at its third step, and the retry is at 12."""
    progress = {"steps": 0}

    @find_executable_batch_size(starting_batch_size=16, reduce_batch_size_fn=lambda: 12)
    def train(batch_size):
        accelerator.free_memory()
        model, optimizer = accelerator.prepare(torch.nn.Linear(1, 1), torch.optim.SGD([torch.zeros(1)], lr=0.0))
        loader = torch.utils.data.DataLoader(DATA, batch_size=batch_size)
        loader = accelerator.prepare(loader) if prepared else loader
        if progress["steps"]:
            accelerator.load_state(where)
            loader = skip(loader, progress["steps"])
        for step, (x, _) in enumerate(loader, start=progress["steps"] + 1):
            trained.extend(int(v) for v in x.flatten())
            if batch_size > 12 and step == 3:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
            if step % 2 == 0:
                accelerator.save_state(where)
                progress["steps"] = step
        return batch_size

    return train


@pytest.mark.parametrize("prepared", [True, False], ids=["prepared-loader", "plain-loader"])
def test_the_module_level_skip_first_batches_in_a_retry_is_one_warning_at_the_users_line(
        accelerator, tmp_path, prepared):
    trained: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resuming(accelerator, tmp_path / "ckpt", trained, prepared=prepared)() == 12
    found = [w for w in caught if "skip_first_batches" in str(w.message)]
    assert len(found) == 1 and "samples 24-31 are trained twice" in str(found[0].message)
    assert found[0].filename == __file__  # the user's skip line, not Accelerate's
    assert sorted(trained).count(24) == 2  # what it says


def test_the_method_and_the_function_together_warn_once_and_a_skip_outside_a_call_is_not_watched(
        accelerator, tmp_path):
    sampler_init = accelerate.data_loader.SkipBatchSampler.__init__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        both = lambda loader, n: skip_first_batches(accelerator.skip_first_batches(loader, n), 0)  # noqa: E731
        assert resuming(accelerator, tmp_path / "ckpt", [], skip=both)() == 12
        skip_first_batches(torch.utils.data.DataLoader(DATA, batch_size=4), 2)  # no call active
    assert len([w for w in caught if "skip_first_batches" in str(w.message)]) == 1
    assert accelerate.data_loader.SkipBatchSampler.__init__ is sampler_init  # put back after the call
