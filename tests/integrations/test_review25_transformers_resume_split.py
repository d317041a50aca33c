"""A run sized with ``fit_batch_size(trainer, global_batch=16)`` trained 4 x 4; resumed by the same
script (its ``TrainingArguments`` say ``gradient_accumulation_steps=1``), the checkpoint's samples
per step were taken as 4 (its per-device 4 times this run's accumulation 1): with ``global_batch=16``
a warning said to pass ``global_batch=4``, and without it the run went on at 4 a step, silently.
``fit_batch_size`` now has each checkpoint record the accumulation in ``trainer_state.json``. The
probe is stubbed (it answers 4): the split under test is the checkpoint's, not the memory's."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

import autobatch.integrations.transformers as transformers_integration  # noqa: E402
from autobatch import ProbeResult  # noqa: E402
from autobatch.integrations.transformers import fit_batch_size  # noqa: E402


def _trainer(output_dir, max_steps: int = 2):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    data = [{"input_ids": [(i * 7 + j) % 64 for j in range(8)]} for i in range(32)]
    arguments = transformers.TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=2, max_steps=max_steps, use_cpu=True, report_to=[],
        save_strategy="steps", save_steps=1, logging_strategy="no", disable_tqdm=True,
        train_sampling_strategy="sequential")
    collate = lambda rows: {"input_ids": torch.tensor([r["input_ids"] for r in rows]),  # noqa: E731
                            "labels": torch.tensor([r["input_ids"] for r in rows])}
    return transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=arguments, train_dataset=data,
                                data_collator=collate)


def _four_fit(step, **options) -> ProbeResult:
    return ProbeResult(batch_size=min(4, options["max_batch"] or 4), strategy="auto", strategy_used="binary",
                       trials=[], capacity_bytes=None, elapsed_s=0.0, margin=0.0)


@pytest.fixture(scope="module")
def sized_run(tmp_path_factory):
    """A run fit_batch_size split into 4 x 4 for global_batch=16, saved after its one step."""
    output_dir = tmp_path_factory.mktemp("sized")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers_integration, "find_max_batch", _four_fit)
        trainer = _trainer(output_dir, max_steps=1)
        fit_batch_size(trainer, global_batch=16)
        trainer.train()
    return output_dir


@pytest.mark.parametrize("global_batch", [None, 16])
def test_the_same_script_resumed_keeps_the_split_the_checkpoint_trained(sized_run, tmp_path, monkeypatch, caplog,
                                                                        global_batch):
    monkeypatch.setattr(transformers_integration, "find_max_batch", _four_fit)
    checkpoint = shutil.copytree(sized_run, tmp_path / "run") / "checkpoint-1"
    trainer = _trainer(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        fit_batch_size(trainer, global_batch=global_batch, resume_from_checkpoint=str(checkpoint))
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (4, 4)
    assert not [r.getMessage() for r in caplog.records if "global_batch=" in r.getMessage()]
    trainer.train(resume_from_checkpoint=str(checkpoint))  # the resumed run saves the record again
    saved = json.loads((tmp_path / "run" / "checkpoint-2" / "trainer_state.json").read_text())
    assert saved["stateful_callbacks"]["AutobatchSplit"]["args"] == {"gradient_accumulation_steps": 4,
                                                                   "train_batch_size": 4, "global_step": 2}


def test_review36_resumed_under_auto_find_batch_size_keeps_the_recorded_accumulation(sized_run, tmp_path, monkeypatch,
                                                                                     caplog):
    """Under ``auto_find_batch_size`` ``train()`` restores the checkpoint's per-device batch (4) but not
    the accumulation ``fit_batch_size`` set (4): the same script resumed (``gradient_accumulation_steps=1``)
    went on at 4 x 1, 4 samples a step where the checkpoint trained 16, silently; and the warning on
    changed samples per step named sizes ``train()`` never runs."""
    monkeypatch.setattr(transformers_integration, "find_max_batch", _four_fit)
    checkpoint = shutil.copytree(sized_run, tmp_path / "run") / "checkpoint-1"
    trainer = _trainer(tmp_path / "run")
    trainer.args.auto_find_batch_size = True
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        fit_batch_size(trainer, resume_from_checkpoint=str(checkpoint))
    assert trainer.args.gradient_accumulation_steps == 4 and not caplog.records
