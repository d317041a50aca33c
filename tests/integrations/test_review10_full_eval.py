"""fit_batch_size under ``bf16_full_eval`` / ``fp16_full_eval``: the ``Trainer`` leaves the model
where it was built (its ``__init__`` skips device placement so that evaluation can cast and move
it in one step) and ``train()`` moves it to ``args.device`` before its first step. The probe must
do the same first: on a GPU the model stayed on the host while the probe's batches went to the
GPU, and the first trial failed with a device-mismatch ``RuntimeError`` (not an out-of-memory
error, so it ended the probe). On the CPU both are the host, so the test watches the move.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations import transformers as integration  # noqa: E402
from autobatch.integrations.transformers import fit_batch_size  # noqa: E402


def pad(samples):
    ids = torch.zeros(len(samples), max(len(s["input_ids"]) for s in samples), dtype=torch.long)
    for row, sample in enumerate(samples):
        ids[row, : len(sample["input_ids"])] = torch.tensor(sample["input_ids"])
    return {"input_ids": ids, "labels": ids}


def make_trainer(tmp_path, **args):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    data = [{"input_ids": [(i * 7 + j) % 64 for j in range(16)]} for i in range(64)]
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, use_cpu=True, report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_drop_last=True, **args)
    return transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=arguments, train_dataset=data,
                                data_collator=pad)


@pytest.mark.parametrize("full_eval", ["bf16_full_eval", "fp16_full_eval"])
def test_the_model_is_placed_on_the_device_before_the_probe_as_train_places_it(tmp_path, monkeypatch, full_eval):
    trainer = make_trainer(tmp_path, **{full_eval: True})
    assert trainer.place_model_on_device is False  # the Trainer left the model where it was built
    events = []
    move = trainer._move_model_to_device
    monkeypatch.setattr(trainer, "_move_model_to_device",
                        lambda model, device: events.append(("moved", model, device)) or move(model, device))
    real = integration.find_max_batch
    monkeypatch.setattr(integration, "find_max_batch", lambda step, **kw: events.append(("probe",)) or real(step, **kw))
    with simulated_memory("12MiB"):
        fit_batch_size(trainer, strategy="binary", max_batch=16)
    assert events[0] == ("moved", trainer.model, trainer.args.device) and ("probe",) in events
    assert events.index(("probe",)) > 0  # placed before the first trial


def test_a_placed_model_is_not_moved_again(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path)
    monkeypatch.setattr(trainer, "_move_model_to_device", lambda *a: pytest.fail("moved a model already placed"))
    with simulated_memory("12MiB"):
        fit_batch_size(trainer, strategy="binary", max_batch=16)
