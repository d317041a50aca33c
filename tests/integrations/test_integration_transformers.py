"""fit_batch_size with a real transformers.Trainer and a tiny GPT-2 built locally (no download)."""

from __future__ import annotations

import itertools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.transformers import fit_batch_size, longest_sample  # noqa: E402

BUDGET = "12MiB"
LENGTHS = [8, 40, 12, 24] * 16  # the longest sample (40 tokens) decides the batch


class PadCollator:
    """Pads to the batch's longest sample; records the batch sizes it built."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, samples):
        self.sizes.append(len(samples))
        width = max(len(s["input_ids"]) for s in samples)
        ids = torch.zeros(len(samples), width, dtype=torch.long)
        mask = torch.zeros(len(samples), width, dtype=torch.long)
        for row, sample in enumerate(samples):
            ids[row, : len(sample["input_ids"])] = torch.tensor(sample["input_ids"])
            mask[row, : len(sample["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def make_trainer(tmp_path, collator, **args):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    data = [{"input_ids": [(i * 7 + j) % 64 for j in range(n)]} for i, n in enumerate(LENGTHS)]
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, use_cpu=True, report_to=[],
        save_strategy="no", logging_strategy="no", dataloader_drop_last=True, **args,
    )
    return transformers.Trainer(model=model, args=arguments, train_dataset=data, data_collator=collator)


def test_longest_sample_is_the_longest_sequence():
    assert len(longest_sample([{"input_ids": [1] * n} for n in (3, 9, 4)])["input_ids"]) == 9


def test_sets_the_batch_and_accumulation_and_train_runs_under_the_same_budget(tmp_path):
    collator = PadCollator()
    trainer = make_trainer(tmp_path, collator)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with simulated_memory(BUDGET):
        result = fit_batch_size(trainer, global_batch=60, strategy="binary", margin=0.02)
        after = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        probed = len(collator.sizes)
        trainer.train()
    size, accumulation = trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps
    assert 1 < size <= result.batch_size < 60 and size * accumulation == 60
    assert trainer.optimizer is not None and all(torch.equal(before[k], after[k]) for k in before)
    assert set(collator.sizes[probed:]) == {size}  # train() built its batches at the probed size
    assert trainer.state.global_step == 2


def test_the_trainers_loop_is_probed_as_a_hand_loop(tmp_path, monkeypatch):
    """The Trainer cannot replay a step that runs out of memory: its probe says so (hand_loop),
    so the answer's trial must stop flushing the allocator's cache, as for a plain callable;
    an explicit probe option still wins."""
    import autobatch.integrations.transformers as integration

    seen = []
    real = integration.find_max_batch
    monkeypatch.setattr(integration, "find_max_batch", lambda step, **kw: seen.append(kw["hand_loop"]) or real(step, **kw))
    with simulated_memory(BUDGET):
        fit_batch_size(make_trainer(tmp_path, PadCollator()), strategy="binary")
        fit_batch_size(make_trainer(tmp_path, PadCollator()), strategy="binary", hand_loop=False)
    assert seen == [True, False]


def test_a_stream_is_read_for_its_first_samples_only(caplog):
    """An endless IterableDataset (which the Trainer takes with max_steps) must not hang the
    search for the longest sample."""
    from autobatch.integrations.transformers import STREAM_SAMPLES

    class Endless(torch.utils.data.IterableDataset):
        def __iter__(self):
            for i in itertools.count():
                yield {"input_ids": list(range(1 + i % 7 + (i == 3 * STREAM_SAMPLES)))}

    with caplog.at_level("WARNING", logger="autobatch"):
        longest = longest_sample(Endless())
    assert len(longest["input_ids"]) == 7 and "no length" in caplog.text


def test_the_batch_is_capped_at_each_processs_share_of_the_training_set(tmp_path):
    """A per-device batch larger than the training set trains nothing under drop_last (an
    epoch of no batch); the probe stops at the set's length (64 samples here)."""
    trainer = make_trainer(tmp_path, PadCollator())
    with simulated_memory("1GiB"):
        result = fit_batch_size(trainer, strategy="binary")
        trainer.train()
    assert result.batch_size == trainer.args.per_device_train_batch_size == len(LENGTHS)
    assert trainer.state.global_step == 2


def test_an_accumulated_answer_is_probed_with_the_earlier_micro_batches_gradients_held(tmp_path, monkeypatch):
    """With gradient accumulation the Trainer's later micro-batches run beside the earlier ones'
    gradients, which a one-batch step never holds: the probed step runs two micro-batches where
    the Trainer would accumulate, and train() runs under the same budget (a Trainer of this
    shape set to the one-batch answer, 3 x 2, ran out of memory in the softmax backward in a
    user's script)."""
    import autobatch.integrations.transformers as integration
    from autobatch.integrations.transformers_step import TrainerStep

    probed = []
    real = integration.find_max_batch
    monkeypatch.setattr(integration, "find_max_batch", lambda step, **kw: probed.append(step) or real(step, **kw))
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=16384, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    data = [{"input_ids": [(i * 7 + j) % 16384 for j in range(40)]} for i in range(256)]
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, use_cpu=True, report_to=[],
        save_strategy="no", logging_strategy="no")
    trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=arguments, train_dataset=data,
                                   data_collator=PadCollator())
    with simulated_memory("40MiB"):
        fit_batch_size(trainer, global_batch=6, cache=False, estimate_first=False)  # the prior: most of the time
        trainer.train()  # an OOM here fails the test
    size, accumulation = trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps
    assert size * accumulation == 6 and accumulation > 1
    assert len(probed) == 1 and isinstance(probed[0], TrainerStep) and probed[0].share == 6
    assert trainer.state.global_step == 3


def test_a_global_batch_larger_than_the_training_set_is_one_error(tmp_path):
    """Every epoch would end before one global batch, so each optimizer step would train fewer
    samples than asked for: refused before any trial, naming both figures."""
    trainer = make_trainer(tmp_path, PadCollator())
    with pytest.raises(ValueError, match=f"global_batch=128 is larger than the training set \\({len(LENGTHS)} samples"):
        fit_batch_size(trainer, global_batch=128)


def vit_trainer(tmp_path, data, size=1, **args):
    """A tiny ViT's Trainer; ``data`` made before the simulated budget (a host-side dataset)."""
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=128, num_labels=10)
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=size, max_steps=3, use_cpu=True, report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_drop_last=True, **args)
    return transformers.Trainer(model=transformers.ViTForImageClassification(config), args=arguments,
                                train_dataset=data, data_collator=transformers.default_data_collator)


@pytest.mark.parametrize("global_batch", [None, 480])
def test_the_answer_trains_where_the_trainer_holds_its_inputs(tmp_path, global_batch):
    """The Trainer's loop holds every micro-batch of an optimizer step (and the loader's
    look-ahead) through forward, backward and the optimizer step; a bare step lets its inputs go
    after forward. Probing the bare step, a ViT's answer (184) ran out of memory in train() under
    the same budget, and so did 179; the Trainer's own step answers a size train() runs, and a
    few percent more does not."""
    data = [{"pixel_values": torch.randn(3, 32, 32), "labels": i % 10} for i in range(1024)]
    with simulated_memory("24MiB"):
        trainer = vit_trainer(tmp_path, data)
        result = fit_batch_size(trainer, global_batch=global_batch, cache=False)
        trainer.train()  # an OOM here fails the test
        size, accumulation = trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps
        assert trainer.state.global_step == 3 and size * accumulation == (global_batch or size)
        if global_batch is None:
            trainer.model = trainer.model_wrapped = trainer.optimizer = None  # its memory back
            over = vit_trainer(tmp_path, data, size=int(result.batch_size * 1.03) + 1)
            with pytest.raises(torch.OutOfMemoryError):
                over.train()


def test_under_native_mixed_precision_the_probe_runs_the_forward_accelerate_prepares(tmp_path):
    """Under bf16 Accelerate's prepare_model wraps the forward in autocast and converts its
    outputs to fp32 (a float copy of the logits a bare autocast never makes): the trials run that
    forward, and the model's own forward is back after the probe."""
    seen = []

    class Recording(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
            seen.append(outputs.logits.dtype)
            return (loss, outputs) if return_outputs else loss

    torch.manual_seed(0)
    trainer = make_trainer(tmp_path, PadCollator(), bf16=True)
    trainer = Recording(model=trainer.model, args=trainer.args, train_dataset=trainer.train_dataset,
                        data_collator=trainer.data_collator)
    assert trainer.accelerator.native_amp
    try:
        with simulated_memory(BUDGET):
            fit_batch_size(trainer, strategy="binary", cache=False)
    finally:  # Accelerate's process-wide state kept bf16: a later Accelerator() autocast its forward too
        from accelerate.state import AcceleratorState
        AcceleratorState._reset_state()
    assert seen and set(seen) == {torch.float32}
    assert "forward" not in vars(trainer.model)


def test_the_worst_case_sample_takes_each_field_at_its_longest():
    """A collator pads each field to its own longest in the batch, so a seq2seq batch may pair
    one sample's long source with another's long target; a multiple-choice sample's size is its
    choices times its longest choice, not the number of choices."""
    seq2seq = [{"input_ids": [1] * 120, "attention_mask": [1] * 120, "labels": [2] * 8},
               {"input_ids": [1] * 8, "attention_mask": [1] * 8, "labels": [2] * 110}]
    worst = longest_sample(seq2seq)
    assert (len(worst["input_ids"]), len(worst["attention_mask"]), len(worst["labels"])) == (120, 120, 110)
    choices = [{"input_ids": [[1] * 16] * 4, "label": 0}, {"input_ids": [[1] * 16] * 3 + [[1] * 128], "label": 1}]
    assert max(len(c) for c in longest_sample(choices)["input_ids"]) == 128


def lm_trainer(tmp_path, budget_model=True, **args):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=2048, n_positions=64, n_embd=96, n_layer=2, n_head=2)
    data = [{"input_ids": [(i * 7 + j) % 2048 for j in range(32)]} for i in range(512)]
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, use_cpu=True, report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, **{"per_device_train_batch_size": 64, **args})
    return transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=arguments, train_dataset=data,
                                data_collator=PadCollator())


def test_the_trainers_own_accumulation_is_probed_where_no_global_batch_is_asked_for(tmp_path):
    """``gradient_accumulation_steps`` already set, no ``global_batch``: the probe holds that
    window (the earlier micro-batches' gradients and inputs), so train() runs at the answer; a
    one-micro-batch probe answered 5 and train() at 5 x 4 ran out of memory."""
    with simulated_memory("12MiB"):
        trainer = lm_trainer(tmp_path, gradient_accumulation_steps=4)
        fit_batch_size(trainer, strategy="binary", cache=False)  # no fake-tensor estimate: 4 s less
        trainer.train()  # an OOM here fails the test
    assert trainer.args.gradient_accumulation_steps == 4 and trainer.state.global_step == 3


def test_the_probe_switches_on_the_checkpointing_train_will(tmp_path):
    """With gradient checkpointing in the arguments, train() checkpoints: the probe does too
    (without it the answer was 8 where train() trained 14)."""
    with simulated_memory("12MiB"):
        plain = fit_batch_size(lm_trainer(tmp_path), strategy="binary", cache=False).batch_size
        trainer = lm_trainer(tmp_path, gradient_checkpointing=True)
        checkpointed = fit_batch_size(trainer, strategy="binary", cache=False).batch_size
        trainer.train()
    assert checkpointed > plain and trainer.model.is_gradient_checkpointing


def test_columns_the_model_does_not_take_are_removed_as_train_removes_them(tmp_path):
    """``remove_unused_columns`` (the default): the Trainer's collator drops a ``text`` column
    before collating; the probe's batches are built the same way, not by the raw collator."""
    def collate(samples):
        assert "text" not in samples[0], "the probe collated a column the model does not take"
        return PadCollator()(samples)

    torch.manual_seed(0)
    data = [{"input_ids": [(i * 7 + j) % 64 for j in range(n)], "text": "raw"} for i, n in enumerate(LENGTHS)]
    trainer = make_trainer(tmp_path, collate)
    trainer.train_dataset = data
    with simulated_memory(BUDGET):
        fit_batch_size(trainer, strategy="binary", cache=False)
        trainer.train()


def test_the_micro_batch_stays_a_multiple_with_a_global_batch(tmp_path):
    """``multiple_of`` holds for the size set, not just the probe's answer (40 = 8 x 5, not 10 x 4)."""
    with simulated_memory("1GiB"):
        trainer = make_trainer(tmp_path, PadCollator())
        fit_batch_size(trainer, global_batch=40, multiple_of=8, max_batch=16, strategy="binary", cache=False)
    assert trainer.args.per_device_train_batch_size % 8 == 0
    assert trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps == 40


def test_an_edited_trainer_subclass_misses_the_cache(tmp_path):
    """The cache key holds the subclass's own code whole: a ``compute_loss`` edited in a notebook
    (two forwards, R-Drop) is probed again, not answered from the old entry."""
    from autobatch.integrations.transformers_step import trainer_key

    def subclass(passes):
        class MyTrainer(transformers.Trainer):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                total = 0
                for _ in range(passes):
                    total = total + super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
                return total / passes
        return MyTrainer

    cached = []
    for passes in (1, 2, 1):
        base = make_trainer(tmp_path, PadCollator())
        trainer = subclass(passes)(model=base.model, args=base.args, train_dataset=base.train_dataset,
                                   data_collator=base.data_collator)
        with simulated_memory(BUDGET):
            cached.append(fit_batch_size(trainer, strategy="binary", cache=tmp_path / "cache").cached)
    assert cached == [False, False, True]
    assert isinstance(trainer_key(trainer), str)  # one digest: the key's depth limit cannot cut it


def test_the_cache_key_reads_the_checkpointing_the_probe_switches_on(tmp_path):
    """The key reads checkpointing where the probe does (``activation_checkpointing`` in
    transformers 5, ``gradient_checkpointing`` before): a run with it must not be answered from
    the entry of one without it."""
    from autobatch.integrations.transformers_step import trainer_key

    plain = trainer_key(lm_trainer(tmp_path))
    names = [name for name in ("activation_checkpointing", "gradient_checkpointing")
             if hasattr(transformers.TrainingArguments, name)]
    for name in names:
        assert trainer_key(lm_trainer(tmp_path, **{name: True})) != plain
