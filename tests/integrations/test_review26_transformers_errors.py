"""A non-OOM error in the model's forward during ``fit_batch_size``'s probe reaches the caller as
the same exception object, with the trainer left as it was (no optimizer made for the probe kept,
the weights untouched): only out-of-memory errors are the probe's to handle."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from test_integration_transformers import PadCollator, make_trainer  # noqa: E402

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.transformers import fit_batch_size  # noqa: E402


@pytest.mark.parametrize("error", [RuntimeError("shape mismatch in my layer"), KeyError("position_ids")])
def test_a_non_oom_error_in_forward_propagates_unchanged(tmp_path, error):
    trainer = make_trainer(tmp_path, PadCollator())
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}

    def broken(*args, **kwargs):
        raise error

    trainer.model.transformer.forward = broken
    with simulated_memory("12MiB"), pytest.raises(type(error)) as raised:
        fit_batch_size(trainer, strategy="binary")
    assert raised.value is error
    assert trainer.optimizer is None and trainer.args.per_device_train_batch_size == 2
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
