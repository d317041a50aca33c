"""Review 30: an Accelerate user's ``reduce_batch_size_fn`` mistakes, and a checkpoint resumed by
several retries, under :func:`autobatch.find_executable_batch_size`.

* ``reduce_batch_size_fn=lambda bs: bs // 2`` was accepted and failed only after the first
  out-of-memory error, with Python's "missing 1 required positional argument": now a ``TypeError``
  where it decorates, naming the hook.
* a hook that forgot its ``return`` failed with ``int() argument must be ... not 'NoneType'``,
  naming nothing: now one ``TypeError`` naming the hook.
* a checkpoint resumed with ``skip_first_batches`` by two retries at two sizes warned once, with the
  first retry's figures; the attempt that ran trained other samples twice: one more warning names those.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from accelerator_cpu import accelerator  # noqa: F401 - the fixture (skips without accelerate)
from autobatch import find_executable_batch_size

DATA = torch.utils.data.TensorDataset(torch.arange(64.0).unsqueeze(1), torch.zeros(64, 1))


def _oom(batch_size):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")


def test_a_reduce_batch_size_fn_that_takes_an_argument_is_refused_where_it_decorates():
    with pytest.raises(TypeError, match=r"reduce_batch_size_fn .*must take no arguments.*train\.batch_size // 2"):
        find_executable_batch_size(_oom, starting_batch_size=8, reduce_batch_size_fn=lambda bs: bs // 2)


def test_a_reduce_batch_size_fn_that_returns_none_is_one_error_naming_it():
    train = find_executable_batch_size(_oom, starting_batch_size=8, reduce_batch_size_fn=lambda: None)
    with pytest.raises(TypeError, match=r"reduce_batch_size_fn returned None; it must return the next batch size"):
        train()


def test_the_retry_that_ran_is_warned_with_its_own_resume_figures(accelerator, tmp_path):
    made, progress, where = accelerator, {"steps": 0}, tmp_path / "ckpt"

    @find_executable_batch_size(starting_batch_size=16, reduce_batch_size_fn=lambda: {16: 12, 12: 8}[train.batch_size])
    def train(batch_size):
        made.free_memory()
        model, optimizer = made.prepare(torch.nn.Linear(1, 1), torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), 0.0))
        loader = made.prepare(torch.utils.data.DataLoader(DATA, batch_size=batch_size))
        if progress["steps"]:
            made.load_state(where)
            loader = made.skip_first_batches(loader, progress["steps"])
        for step, (x, y) in enumerate(loader, start=progress["steps"] + 1):
            if batch_size > 8 and step == 3:  # 16 after its checkpoint at step 2, 12 at its first step
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
            if step % 2 == 0:
                made.save_state(where)
                progress["steps"] = step
        return batch_size

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert train() == 8
    said = [str(w.message) for w in caught if "skip_first_batches" in str(w.message)]
    assert len(said) == 2 and "samples 24-31 are trained twice" in said[0]  # the retry at 12 (2 x 12 of 2 x 16)
    assert "the retry that ran, at batch 8" in said[1] and "samples 16-31 are trained twice" in said[1]
