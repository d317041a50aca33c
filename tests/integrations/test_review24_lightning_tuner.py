"""Review 24: a user moving from ``Tuner(trainer).scale_batch_size(model)`` who adds
``AutoBatchSize`` and keeps the tuner call gets one ``ValueError`` (both set the batch size). The
Tuner removes its ``BatchSizeFinder`` only after a fit that returns, so it stayed in
``trainer.callbacks`` and the next ``trainer.fit`` (the tuner line removed, the same Trainer,
as in a notebook) failed with the same error, telling to remove a callback the user never added.
Now the Tuner's finder is taken out, and the message names the tuner call."""

from __future__ import annotations

import pytest

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.callbacks import BatchSizeFinder  # noqa: E402
from lightning.pytorch.tuner import Tuner  # noqa: E402

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402

from test_integration_lightning import BUDGET, Tiny, trainer  # noqa: E402


def test_a_refused_tuner_call_leaves_the_trainer_as_built_and_the_next_fit_trains():
    module, callback = Tiny(), AutoBatchSize(memory_limit=BUDGET, confirm=False, max_batch=32)
    fit = trainer(callback)
    with simulated_memory(BUDGET):
        with pytest.raises(ValueError, match=r"remove the Tuner\(trainer\).scale_batch_size\(...\) call"):
            Tuner(fit).scale_batch_size(module)
        assert not any(isinstance(other, BatchSizeFinder) for other in fit.callbacks)
        fit.fit(module)
    assert callback.batch_size > 2 and module.seen == [callback.batch_size] * 4


def test_a_batch_size_finder_the_user_added_is_named_and_kept():
    finder = BatchSizeFinder(max_trials=1)
    fit = trainer(AutoBatchSize(memory_limit=BUDGET), finder)
    with pytest.raises(ValueError, match=r"remove the BatchSizeFinder callback from Trainer\(callbacks=...\)"):
        fit.fit(Tiny())
    assert finder in fit.callbacks  # the user's own: what to change is theirs
