"""Review 11: fit_batch_size before ``train(resume_from_checkpoint=...)`` keeps the checkpoint's
samples per optimizer step, so the batches Transformers skips are the samples already trained."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_integration_transformers import LENGTHS, PadCollator  # noqa: E402

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.transformers import fit_batch_size  # noqa: E402

SAVED = 16  # the checkpoint's per-device batch; under BUDGET the probe answers 13
BUDGET = "6MiB"


class SeenCollator(PadCollator):
    """Records which samples each batch held (a sample's first token names it: 7 is odd)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def __call__(self, samples):
        self.seen += [(s["input_ids"][0] * 55) % 64 for s in samples]  # 55 = 7^-1 mod 64
        return super().__call__(samples)


def make_trainer(output_dir, max_steps, **args):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    data = [{"input_ids": [(i * 7 + j) % 64 for j in range(n)]} for i, n in enumerate(LENGTHS)]
    arguments = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=max_steps, use_cpu=True, report_to=[], save_strategy="steps",
        save_steps=1, logging_strategy="no", disable_tqdm=True, dataloader_drop_last=True,
        train_sampling_strategy="sequential", **{"per_device_train_batch_size": SAVED, **args})
    return transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=arguments, train_dataset=data,
                                data_collator=SeenCollator())


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A run interrupted after 2 optimizer steps of 16 samples: checkpoint-1 and checkpoint-2."""
    output_dir = tmp_path_factory.mktemp("run")
    make_trainer(output_dir, max_steps=2).train()
    return output_dir


@pytest.fixture
def saved(interrupted, tmp_path):
    """The interrupted run's output_dir, a copy of its own for each test (a resumed run saves more)."""
    return shutil.copytree(interrupted, tmp_path / "run")


def test_resume_keeps_the_checkpoints_samples_per_step_and_trains_the_next_samples(saved):
    """The probe answers fewer than 16 per device under the cap; resuming keeps 16 samples per step
    (per-device x accumulation) and trains samples 32..47 next, as the uninterrupted run would:
    at 16 // b per-device without the kept accumulation, train() would skip 2 batches of b and
    train samples 2b.. again."""
    trainer = make_trainer(saved, max_steps=3)
    with simulated_memory(BUDGET):
        result = fit_batch_size(trainer, resume_from_checkpoint=True, strategy="binary", cache=False)
        probed = len(trainer.data_collator.seen)
        trainer.train(resume_from_checkpoint=True)
    size, accumulation = trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps
    assert size < SAVED and size <= result.batch_size and size * accumulation == SAVED
    # the samples train() collated after the probe (then the loader's look-ahead batch, not trained)
    assert trainer.data_collator.seen[probed:probed + SAVED] == list(range(32, 48))
    assert trainer.state.global_step == 3


def test_a_resume_fit_batch_size_was_not_told_of_is_one_warning_naming_the_argument(saved, caplog):
    trainer = make_trainer(saved, max_steps=3)
    with simulated_memory(BUDGET), caplog.at_level(logging.WARNING, logger="autobatch"):
        fit_batch_size(trainer, strategy="binary", max_batch=SAVED, cache=False)
    assert trainer.args.per_device_train_batch_size < SAVED  # not told: the answer as before
    assert "pass the same resume_from_checkpoint= to fit_batch_size" in caplog.text


def test_a_deliberate_global_batch_is_honoured_with_a_warning(saved, caplog):
    trainer = make_trainer(saved, max_steps=3)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        fit_batch_size(trainer, global_batch=8, resume_from_checkpoint=os.path.join(saved, "checkpoint-2"),
                       max_batch=4, strategy="binary", cache=False)
    assert trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps == 8
    assert "pass global_batch=16 to keep them" in caplog.text


def test_the_arguments_resume_from_checkpoint_is_read_and_false_overrides_it(saved):
    trainer = make_trainer(saved, max_steps=3, resume_from_checkpoint=os.path.join(saved, "checkpoint-1"))
    fit_batch_size(trainer, max_batch=4, strategy="binary", cache=False)
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (4, 4)
    trainer = make_trainer(saved, max_steps=3, resume_from_checkpoint=os.path.join(saved, "checkpoint-1"))
    fit_batch_size(trainer, resume_from_checkpoint=False, max_batch=4, strategy="binary", cache=False)
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (4, 1)


def test_under_auto_find_batch_size_train_restores_the_batch_itself(saved):
    trainer = make_trainer(saved, max_steps=3, auto_find_batch_size=True)
    fit_batch_size(trainer, resume_from_checkpoint=True, max_batch=4, strategy="binary", cache=False)
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (4, 1)


def test_no_checkpoint_and_a_state_without_the_batch(tmp_path, caplog):
    trainer = make_trainer(tmp_path, max_steps=1)
    with pytest.raises(ValueError, match="no checkpoint-N folder"):
        fit_batch_size(trainer, resume_from_checkpoint=True)
    os.makedirs(tmp_path / "checkpoint-3")
    (tmp_path / "checkpoint-3" / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        fit_batch_size(trainer, resume_from_checkpoint=True, max_batch=4, strategy="binary", cache=False)
    assert "records no train_batch_size" in caplog.text and trainer.args.gradient_accumulation_steps == 1
