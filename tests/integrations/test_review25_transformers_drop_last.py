"""``dataloader_drop_last=True`` with the split ``fit_batch_size`` sets for a global batch.

``drop_last`` drops only an epoch's last short *micro*-batch, and ``train()`` steps the batches
left as a last, short window, so a split of 16 into 8 x 2 on 40 samples ends each epoch with a
step of 8. Resuming a run saved at 16 x 1 (2 steps an epoch, 8 samples dropped) at the probe's
8 x 2 trained, silently, those dropped samples as its step 3 and 6 steps where the run had 4
(measured with a real checkpoint, sequential sampling). Both are now one warning. The probe is
stubbed: the answer under test is the split, not the memory."""

from __future__ import annotations

import json
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

import autobatch.integrations.transformers as transformers_integration  # noqa: E402
from autobatch import ProbeResult  # noqa: E402
from autobatch.integrations.transformers import fit_batch_size  # noqa: E402


def _trainer(tmp_path, samples: int):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    data = [{"input_ids": [(i * 7 + j) % 64 for j in range(8)]} for i in range(samples)]
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=16, num_train_epochs=2, dataloader_drop_last=True,
        use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True)
    collate = lambda rows: {"input_ids": torch.tensor([r["input_ids"] for r in rows]),  # noqa: E731
                            "labels": torch.tensor([r["input_ids"] for r in rows])}
    return transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=arguments, train_dataset=data,
                                data_collator=collate)


def _eight_fit(step, **options) -> ProbeResult:  # the device fits batches of 8 (16 does not)
    return ProbeResult(batch_size=min(8, options["max_batch"] or 8), strategy="auto", strategy_used="binary",
                       trials=[], capacity_bytes=None, elapsed_s=0.0, margin=0.0)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "drop_last" in r.getMessage()]


@pytest.mark.parametrize("samples, warned", [(40, True), (36, False)])
def test_a_resume_whose_split_trains_other_epochs_under_drop_last_is_one_warning(tmp_path, monkeypatch, caplog,
                                                                                 samples, warned):
    monkeypatch.setattr(transformers_integration, "find_max_batch", _eight_fit)
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(json.dumps({"train_batch_size": 16, "global_step": 2}))
    trainer = _trainer(tmp_path, samples)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        fit_batch_size(trainer, resume_from_checkpoint=str(checkpoint))
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (8, 2)
    said = _warnings(caplog)
    if not warned:  # 36 samples: 8 x 2 trains the 32 that 16 x 1 trained, the epochs line up
        assert said == []
        return
    assert len(said) == 1 and "trains 40 samples an epoch" in said[0] and "trained 32" in said[0]
    assert "6 steps where it ran 4" in said[0] and "per_device_train_batch_size=16 fits" in said[0]


@pytest.mark.parametrize("samples, warned", [(40, True), (48, False)])
def test_a_global_batch_split_that_ends_each_epoch_with_a_short_step_is_one_warning(tmp_path, monkeypatch, caplog,
                                                                                   samples, warned):
    monkeypatch.setattr(transformers_integration, "find_max_batch", _eight_fit)
    trainer = _trainer(tmp_path, samples)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        fit_batch_size(trainer, global_batch=16)
    said = _warnings(caplog)
    assert len(said) == int(warned)
    if warned:
        assert "ends with an optimizer step of 8 samples where the others train 16" in said[0]
        assert "train on 32 samples" in said[0] and "select(range(32))" in said[0]


@pytest.mark.parametrize("recorded", [True, False])
def test_a_resume_is_compared_with_the_split_its_checkpoint_recorded(tmp_path, monkeypatch, caplog, recorded):
    """A checkpoint of 8 x 2 (recorded by fit_batch_size) resumed at 8 x 2 lines up, its short last
    step included: nothing to say. Unrecorded, its run is taken to have had this run's
    accumulation, 1, so 16 a batch, and 8 x 2 does not line up with that."""
    monkeypatch.setattr(transformers_integration, "find_max_batch", _eight_fit)
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    state = {"train_batch_size": 8 if recorded else 16, "global_step": 2}
    if recorded:
        state["stateful_callbacks"] = {"AutobatchSplit": {"args": {"gradient_accumulation_steps": 2}, "attributes": {}}}
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    trainer = _trainer(tmp_path, 40)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        fit_batch_size(trainer, resume_from_checkpoint=str(checkpoint))
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (8, 2)
    said = _warnings(caplog)
    assert len(said) == int(not recorded) and all("do not line up" in s for s in said)
