"""Review 23: Accelerate's decorator around ``Trainer.train()``, as a user migrating from it writes it.

``trainer.args.per_device_train_batch_size = batch_size; trainer.train()`` inside the decorated
function: the ``Trainer`` copies the size into ``trainer._train_batch_size`` when it is constructed
and ``train()`` builds its loader at that, so every attempt trained the constructor's batch. The
decorator stopped with ``NoBatchFitsError`` saying a ``DataLoader`` built *outside the function*
keeps its size, to build it inside (it is built inside, by ``train()``), and said nothing of the
Trainer. Now the second failed attempt whose loader kept the same batch size, though rebuilt, is
one ``RuntimeWarning`` naming ``trainer._train_batch_size`` and ``fit_batch_size``, and the final
error says the same. The out-of-memory error is a collator's, raised by hand above one sample
(no training runs, so the test stays fast)."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402
from test_integration_transformers import PadCollator, make_trainer  # noqa: E402

from autobatch import NoBatchFitsError, find_executable_batch_size  # noqa: E402


class CappedCollator(PadCollator):
    """Runs out of memory on batches above ``cap`` samples, as a device too small for them would."""

    cap = 1

    def __call__(self, samples):
        if len(samples) > self.cap:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {len(samples)}.00 MiB")
        return super().__call__(samples)


def test_a_trainer_whose_loader_keeps_its_size_is_named_with_what_to_call(tmp_path):
    trainer = make_trainer(tmp_path, CappedCollator())  # per_device_train_batch_size=2

    @find_executable_batch_size(starting_batch_size=4, reduce_batch_size_fn=lambda: run.batch_size // 2)
    def run(batch_size):
        trainer.args.per_device_train_batch_size = batch_size  # ignored: the Trainer copied 2 at construction
        trainer.train()

    with warnings.catch_warnings(record=True) as caught, pytest.raises(NoBatchFitsError) as raised:
        warnings.simplefilter("always")
        run()
    said = [str(w.message) for w in caught if "_train_batch_size" in str(w.message)]
    assert len(said) == 1 and "batch_size=2" in said[0] and "fit_batch_size(trainer)" in said[0]
    assert "trainer._train_batch_size" in str(raised.value) and "fit_batch_size(trainer)" in str(raised.value)
    assert "built outside the function" not in str(raised.value)  # train() builds it, inside
    assert [attempt.batch_size for attempt in run.attempts] == [4, 2, 1]
