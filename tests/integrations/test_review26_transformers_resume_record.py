"""The split record ``fit_batch_size`` has each checkpoint carry (``AutobatchSplit`` in
``trainer_state.json``) must say what the run that saved the checkpoint trained.

* A run resumed by plain ``trainer.train(resume_from_checkpoint=...)``, without ``fit_batch_size``,
  loads the checkpoint's state, record included, and saved it unchanged in its own checkpoints: a
  later resume read the 4 x 4 the first run trained where that run trained 2 x 1, silently.
* A run resumed *with* ``fit_batch_size`` at another per-device batch recorded its accumulation,
  but Transformers keeps the checkpoint's ``train_batch_size`` in a resumed state: 2 x 8 was read
  back as 4 x 8, 32 samples a step where it trained 16.

The probe is stubbed (it answers ``ANSWER["size"]``): the split under test is the checkpoint's."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

import autobatch.integrations.transformers as transformers_integration  # noqa: E402
from autobatch import ProbeResult  # noqa: E402
from autobatch.integrations.transformers import fit_batch_size  # noqa: E402
from autobatch.integrations.transformers_resume import checkpoint_accumulation, checkpoint_batch  # noqa: E402

ANSWER = {"size": 4}


def _trainer(output_dir, max_steps: int, per_device: int = 2):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    data = [{"input_ids": [(i * 7 + j) % 64 for j in range(8)]} for i in range(32)]
    arguments = transformers.TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=per_device, max_steps=max_steps, use_cpu=True,
        report_to=[], save_strategy="steps", save_steps=1, logging_strategy="no", disable_tqdm=True,
        train_sampling_strategy="sequential")
    collate = lambda rows: {"input_ids": torch.tensor([r["input_ids"] for r in rows]),  # noqa: E731
                            "labels": torch.tensor([r["input_ids"] for r in rows])}
    return transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=arguments, train_dataset=data,
                                data_collator=collate)


def _fit(step, **options) -> ProbeResult:
    size = min(ANSWER["size"], options["max_batch"] or ANSWER["size"])
    return ProbeResult(batch_size=size, strategy="auto", strategy_used="binary", trials=[], capacity_bytes=None,
                       elapsed_s=0.0, margin=0.0)


@pytest.fixture(scope="module")
def sized_run(tmp_path_factory):
    """A run fit_batch_size split into 4 x 4 for global_batch=16, saved after its one step."""
    output_dir = tmp_path_factory.mktemp("sized")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers_integration, "find_max_batch", _fit)
        ANSWER["size"] = 4
        trainer = _trainer(output_dir, max_steps=1)
        fit_batch_size(trainer, global_batch=16)
        trainer.train()
    return output_dir


def test_a_plain_resume_does_not_pass_the_first_runs_split_on(sized_run, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(transformers_integration, "find_max_batch", _fit)
    run = shutil.copytree(sized_run, tmp_path / "run")
    plain = _trainer(run, max_steps=2)  # 2 x 1, no fit_batch_size
    plain.train(resume_from_checkpoint=str(run / "checkpoint-1"))
    assert checkpoint_accumulation(str(run / "checkpoint-2")) is None  # the 4 carried over is not this run's
    ANSWER["size"] = 4
    trainer = _trainer(run, max_steps=3)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        fit_batch_size(trainer, resume_from_checkpoint=str(run / "checkpoint-2"))
    assert trainer.args.gradient_accumulation_steps == plain.args.gradient_accumulation_steps  # not the 4 x 4
    warned = [r.getMessage() for r in caplog.records if "did not size" in r.getMessage()]
    assert len(warned) == 1 and "global_batch=" in warned[0]


def test_a_resume_at_another_batch_records_the_batch_it_trained(sized_run, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(transformers_integration, "find_max_batch", _fit)
    run = shutil.copytree(sized_run, tmp_path / "run")
    ANSWER["size"] = 2  # another card: the 16 a step kept as 2 x 8
    trainer = _trainer(run, max_steps=2)
    fit_batch_size(trainer, resume_from_checkpoint=str(run / "checkpoint-1"))
    split = (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps)
    trainer.train(resume_from_checkpoint=str(run / "checkpoint-1"))
    saved = str(run / "checkpoint-2")
    assert (checkpoint_batch(saved), checkpoint_accumulation(saved)) == split
    again = _trainer(run, max_steps=3)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        fit_batch_size(again, resume_from_checkpoint=saved)
    assert again.args.per_device_train_batch_size * again.args.gradient_accumulation_steps == split[0] * split[1]
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "global_batch=" in r.getMessage()]
