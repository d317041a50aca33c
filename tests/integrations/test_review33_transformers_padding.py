"""Review 33, a Hugging Face user with a frozen base and a padding collator.

The probe built every batch from the longest sample alone, so its batches were never padded: the
attention mask was all ones, which a BERT's attention drops, where ``train()``'s padded batches build
a mask of batch x heads x length x length. A frozen BERT (its classifier head trained; simulated
16 MiB) was answered 84 and ``train()`` at 84 ran out of memory in that mask; with a short sample
padded beside the longest the answer is 76, which trains (77 is the largest that does)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_review19_samples_per_step import _answer  # noqa: E402

import autobatch.integrations.transformers as transformers_integration  # noqa: E402
from autobatch.integrations.transformers import fit_batch_size  # noqa: E402
from autobatch.integrations.transformers_samples import probe_samples  # noqa: E402


class _Tokenizer:
    """What ``DataCollatorWithPadding`` needs of a tokenizer: ``pad``, to the longest in the batch."""

    pad_token_id, padding_side, model_input_names = 0, "right", ["input_ids", "attention_mask"]

    def pad(self, features, return_tensors="pt", **_):
        longest = max(len(f["input_ids"]) for f in features)
        return {key: torch.tensor([f[key] + [0] * (longest - len(f[key])) for f in features])
                for key in ("input_ids", "attention_mask")} | {"labels": torch.tensor([f["labels"] for f in features])}


def _probed_batch(tmp_path, monkeypatch, lengths: list[int]) -> dict:
    """A batch of 3 the probe trains for a frozen BERT (head trained) on samples of ``lengths``."""
    steps = []
    monkeypatch.setattr(transformers_integration, "find_max_batch", lambda step, **_: steps.append(step) or _answer(3))
    config = transformers.BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=8, max_position_embeddings=16)
    model = transformers.BertForSequenceClassification(config).requires_grad_(False)
    model.classifier.requires_grad_(True)
    rows = [{"input_ids": [5] * n, "attention_mask": [1] * n, "labels": 1} for n in lengths]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows,
                                   data_collator=transformers.DataCollatorWithPadding(_Tokenizer()))
    fit_batch_size(trainer)
    return steps[0]._host_batch(3)


def test_review33_probe_pads_its_batches_as_the_collator_pads_the_run(tmp_path, monkeypatch):
    padded = _probed_batch(tmp_path, monkeypatch, [4, 12, 7, 2])
    assert padded["attention_mask"].shape == (3, 12)  # at the longest sample's length
    assert (padded["attention_mask"] == 0).any()  # and padded, as train()'s batches of this set are
    uniform = [{"input_ids": [5] * 12, "attention_mask": [1] * 12, "labels": 1}] * 3
    assert probe_samples(uniform) == (uniform[0], None)  # packed text, one length: no padding to probe


def test_review34_the_log_says_which_padded_length_was_probed():
    """Nothing said which length the probe's padded batches had. The note (in the INFO line naming the
    size and in ``result.notes``) gives it, as the collator padded it, and the samples' lengths."""
    from autobatch.integrations.transformers_padding import padded_length, padding_note

    longest = {"input_ids": [5] * 12, "attention_mask": [1] * 12, "labels": 1}
    short = {"input_ids": [5] * 2, "attention_mask": [1] * 2, "labels": 0}
    batch = _Tokenizer().pad([longest, short])
    assert padding_note("input_ids", padded_length(batch, "input_ids"), longest, short, True) == (
        "input_ids padded to length 12: the training set's longest sample has 12, its shortest 2, in each probed batch")
    assert padding_note("input_ids", 12, longest, None, True) == (
        "input_ids of length 12, unpadded: every sample of the training set has 12")
    assert padding_note("input_ids", 16, longest, None, True).startswith("input_ids padded to length 16:")  # a multiple of 8
    assert padding_note("input_ids", 12, longest, None, None).endswith("the sample= given has 12, probed alone")
    image = {"pixel_values": torch.ones(3, 8, 8), "labels": 1}  # not a token sequence: no length to tell
    assert padding_note("pixel_values", padded_length({"pixel_values": torch.ones(2, 3, 8, 8)}, "pixel_values"),
                        image, None, True) is None
