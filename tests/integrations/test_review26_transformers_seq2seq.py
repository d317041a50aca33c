"""A ``Seq2SeqTrainer`` user on ``fit_batch_size``: a tiny T5 from config, ``DataCollatorForSeq2Seq``
(labels padded with -100), ``predict_with_generate=True``.

T5 and BART (transformers 5) take ``**kwargs`` in forward, so the ``Trainer`` leaves the loss's
normalisation to them (``model_accepts_loss_kwargs``) and does not divide by the accumulation, but
their loss is a plain mean that ignores ``num_items_in_batch``: a ``global_batch`` split into 8 x 2
stepped 2x the gradient of 16 x 1, silently. ``fit_batch_size`` now says so, naming the fix; GPT-2,
which honours ``num_items_in_batch``, is not warned about."""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from test_integration_transformers import PadCollator, make_trainer  # noqa: E402
from test_review19_samples_per_step import _answer  # noqa: E402

import autobatch.integrations.transformers as transformers_integration  # noqa: E402
from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.transformers import fit_batch_size  # noqa: E402

WARNED = "ignores num_items_in_batch"


def _tokenizer():
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="</s>",
                                                unk_token="<unk>")


def _seq2seq_trainer(tmp_path, **args):
    torch.manual_seed(0)
    tokenizer = _tokenizer()
    config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = transformers.T5ForConditionalGeneration(config)

    def row(i):  # sources of 4-23 words, targets of 2-31: the longest of each in different rows
        sample = tokenizer(" ".join(f"w{(i * 3 + j) % 61}" for j in range(4 + i % 20)))
        sample["labels"] = tokenizer(text_target=" ".join(f"w{(i + j) % 61}" for j in range(2 + i * 7 % 30)))["input_ids"]
        return dict(sample)

    data = [row(i) for i in range(32)]
    arguments = transformers.Seq2SeqTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, use_cpu=True, report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=True, predict_with_generate=True,
        generation_max_length=6, per_device_eval_batch_size=4, **args)
    collator = transformers.DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    return transformers.Seq2SeqTrainer(model=model, args=arguments, train_dataset=data, eval_dataset=data[:4],
                                       data_collator=collator, processing_class=tokenizer,
                                       compute_metrics=lambda p: {"rows": float(len(p.predictions))})


def test_a_seq2seq_trainer_sized_for_a_global_batch_trains_and_generates(tmp_path):
    trainer = _seq2seq_trainer(tmp_path)
    with simulated_memory("2MiB"):
        result = fit_batch_size(trainer, global_batch=16, strategy="binary")
        trainer.train()
    metrics = trainer.evaluate()
    size, accumulation = trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps
    assert size <= result.batch_size and size * accumulation == 16 and trainer.state.global_step == 1
    assert metrics["eval_rows"] == 4 and metrics["eval_loss"] > 0  # generated over the eval set


@pytest.mark.parametrize("model", ["t5", "gpt2"])
def test_an_accumulated_split_of_a_loss_that_ignores_num_items_is_one_warning(tmp_path, monkeypatch, caplog, model):
    monkeypatch.setattr(transformers_integration, "find_max_batch", lambda step, **options: _answer(8))
    trainer = _seq2seq_trainer(tmp_path) if model == "t5" else make_trainer(tmp_path, PadCollator())
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        fit_batch_size(trainer, global_batch=16)
    assert trainer.args.gradient_accumulation_steps == 2
    said = [r.getMessage() for r in caplog.records if WARNED in r.getMessage()]
    assert len(said) == int(model == "t5")
    if said:
        assert "gradient_accumulation_steps=2" in said[0] and "trainer.model_accepts_loss_kwargs = False" in said[0]
    assert all(module.training for module in trainer.model.modules())  # the check's eval() is put back


def test_the_warnings_fix_averages_the_accumulated_gradient(tmp_path, monkeypatch):
    """Following the warning (model_accepts_loss_kwargs=False), one SGD step at 8 x 2 moves the
    weights as 16 x 1 does; without it, twice as far."""
    monkeypatch.setattr(transformers_integration, "find_max_batch", lambda step, **options: _answer(8))
    moved = {}
    for answer, fixed in [(16, False), (8, False), (8, True)]:
        monkeypatch.setattr(transformers_integration, "find_max_batch", lambda step, a=answer, **options: _answer(a))
        trainer = _seq2seq_trainer(tmp_path / f"{answer}{fixed}", optim="sgd", learning_rate=0.01, max_grad_norm=0.0,
                                   train_sampling_strategy="sequential")
        start = [p.detach().clone() for p in trainer.model.parameters()]
        fit_batch_size(trainer, global_batch=16)
        trainer.model_accepts_loss_kwargs = not fixed
        trainer.train()
        moved[answer, fixed] = sum((p - q).abs().sum().item() for p, q in zip(trainer.model.parameters(), start))
    assert moved[8, True] == pytest.approx(moved[16, False], rel=1e-3)
    assert moved[8, False] == pytest.approx(2 * moved[16, False], rel=1e-2)
