"""``fit_batch_size`` where ``Trainer.train()`` would run ``torch.nn.DataParallel``.

A script started with plain ``python`` on a machine with several GPUs gets ``args.n_gpu`` > 1:
``train()`` wraps the model in DataParallel and trains ``per_device_train_batch_size`` x GPUs a
step. The probe answered for one GPU's unwrapped step and the global batch's arithmetic took
one process for one device (a ``global_batch`` of 64 trained 128 a step over two GPUs)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from autobatch.integrations.transformers import fit_batch_size  # noqa: E402
from test_integration_transformers import lm_trainer  # noqa: E402


def test_several_gpus_in_one_process_is_one_error_naming_torchrun(tmp_path, monkeypatch):
    trainer = lm_trainer(tmp_path)
    monkeypatch.setattr(type(trainer.args), "n_gpu", property(lambda self: 2))
    before = (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps)
    with pytest.raises(ValueError, match=r"sees 2 GPUs.*DataParallel.*torchrun --nproc-per-node 2.*CUDA_VISIBLE_DEVICES"):
        fit_batch_size(trainer, global_batch=64, memory_limit="12MiB", cache=False)
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == before


def test_one_device_per_process_is_not_refused():
    from types import SimpleNamespace

    from autobatch.integrations.transformers import _refuse_data_parallel

    for gpus, world in ((0, 1), (1, 1), (1, 4), (None, 1)):  # the CPU, one GPU, torchrun's ranks
        _refuse_data_parallel(SimpleNamespace(n_gpu=gpus, world_size=world))
