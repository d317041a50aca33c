"""fit_batch_size's inputs: samples that are not dicts, datasets that never end on their own, a
loss normalised by ``num_items_in_batch``, sizes refused before any trial, the model's mode.

A tiny GPT-2 built locally (no download) on the CPU's simulated memory, as
``test_integration_transformers.py``.
"""

from __future__ import annotations

import collections
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations import transformers as integration  # noqa: E402
from autobatch.integrations.transformers import fit_batch_size, longest_sample  # noqa: E402
from autobatch.integrations.transformers_step import num_items_in_batch  # noqa: E402

BUDGET = "12MiB"
LENGTHS = [8, 40, 12, 24] * 16  # the longest sample (40 tokens) decides the batch


def pad(samples):
    """Pads token lists (or dicts holding them) to the batch's longest."""
    rows = [s["input_ids"] if isinstance(s, dict) else s for s in samples]
    ids = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(rows):
        ids[row, : len(tokens)], mask[row, : len(tokens)] = torch.as_tensor(tokens), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def make_trainer(tmp_path, data=None, **kwargs):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    if data is None:
        data = [{"input_ids": [(i * 7 + j) % 64 for j in range(n)]} for i, n in enumerate(LENGTHS)]
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, use_cpu=True, report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_drop_last=True)
    return transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=arguments, train_dataset=data,
                                data_collator=pad, **kwargs)


def no_probe(monkeypatch):
    """find_max_batch fails the test if called: an error is due before any trial."""
    monkeypatch.setattr(integration, "find_max_batch", lambda *a, **k: pytest.fail("probed before refusing"))


def test_samples_that_are_not_dicts_are_compared_too(caplog):
    """A list of token ids, a tensor: the largest sample, not the first; a tuple: each position
    at its longest, as a dict's keys; a sample with no padded size: a warning asking for sample=."""
    assert len(longest_sample([[1] * 8, [1] * 40, [1] * 12])) == 40
    assert longest_sample([torch.ones(3, 8), torch.ones(3, 40), torch.ones(2, 50)]).shape == (3, 40)
    pair = longest_sample([([1] * 30, [2] * 4, 0), ([1] * 6, [2] * 25, 1)])
    assert (len(pair[0]), len(pair[1])) == (30, 25) and isinstance(pair, tuple)
    Pair = collections.namedtuple("Pair", "source target")
    named = longest_sample([Pair([1] * 3, [2] * 9), Pair([1] * 7, [2] * 2)])
    assert type(named) is Pair and (len(named.source), len(named.target)) == (7, 9)
    with caplog.at_level("WARNING", logger="autobatch"):
        first = object()
        assert longest_sample([first, object()]) is first
    assert "pass sample=" in caplog.text


def test_list_samples_are_probed_at_the_longest_and_train_runs(tmp_path):
    """Probed at the first sample (8 tokens, not 40), the answer was 64, and train() ran out of
    memory under the same budget."""
    rows = [[(i * 7 + j) % 64 for j in range(n)] for i, n in enumerate(LENGTHS)]
    trainer = make_trainer(tmp_path, data=rows)
    with simulated_memory(BUDGET):
        fit_batch_size(trainer, strategy="binary", cache=False)
        trainer.train()  # an OOM here fails the test
    assert trainer.args.per_device_train_batch_size < len(LENGTHS) and trainer.state.global_step == 2


class Wrapping(torch.utils.data.Dataset):
    """A map-style dataset whose indices wrap (synthetic data): no IndexError past its end, so
    iterating it never stops; this one fails the test instead of hanging it."""

    def __init__(self) -> None:
        self.read = 0

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        self.read += 1
        assert index < 8, "read past the end of the dataset"
        return {"input_ids": [1] * (3 + 5 * (index % 4 == 2))}


class SizedStream(torch.utils.data.IterableDataset):
    """An endless stream that gives a length (for progress bars)."""

    def __len__(self) -> int:
        return 5

    def __iter__(self):
        for index in range(20):
            yield {"input_ids": [1] * (2 + index)}
        raise AssertionError("read past the stream's length")


def test_a_dataset_is_read_over_its_length_only():
    dataset = Wrapping()
    assert len(longest_sample(dataset)["input_ids"]) == 8 and dataset.read == 4
    assert len(longest_sample(SizedStream())["input_ids"]) == 6


def count_loss(seen):
    def loss(outputs, labels, num_items_in_batch):
        seen.append(num_items_in_batch is not None)  # not the count: a fake tensor in the estimate's trace
        logits, target = outputs.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
        return torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum") / num_items_in_batch
    return loss


@pytest.mark.parametrize("strategy", ["binary", "estimate"])
def test_a_loss_normalised_by_num_items_in_batch_is_probed(tmp_path, strategy):
    """train() passes training_step the label tokens of the window (compute_loss_func divides by
    them); the probe passes them too, in its trials and in the estimate's trace."""
    seen = []
    trainer = make_trainer(tmp_path, compute_loss_func=count_loss(seen))
    with simulated_memory(BUDGET):
        fit_batch_size(trainer, strategy=strategy, cache=False, max_batch=8)  # capped: fewer traces and trials
    assert seen and all(seen)


def test_num_items_in_batch_is_the_trainers_count_and_needs_no_collective(tmp_path):
    """Over several processes a trainer averaging tokens gathers the count; the probe takes this
    process's times the world size (every process probes the same batches) and runs no collective."""
    trainer = make_trainer(tmp_path, compute_loss_func=count_loss([]))
    batches = [pad([[1] * 5, [1] * 3]), pad([[1] * 4])]
    assert int(num_items_in_batch(trainer, batches)) == int(trainer._get_num_items_in_batch(batches, "cpu"))

    def get_batch_samples(self, iterator, count, device):
        samples = list(iterator)
        return samples, self.accelerator.gather(torch.tensor(len(samples))).sum()

    def collective(tensor):
        pytest.fail("a collective in a trial")

    accelerator = types.SimpleNamespace(gather=collective)
    fake = types.SimpleNamespace(args=types.SimpleNamespace(world_size=4, device="cpu"), accelerator=accelerator)
    fake.get_batch_samples = types.MethodType(get_batch_samples, fake)
    assert int(num_items_in_batch(fake, batches)) == 8 and accelerator.gather is collective


@pytest.mark.parametrize("options, message", [
    ({"max_batch": 0}, "max_batch must be a positive integer or None, got 0"),
    ({"global_batch": 60, "multiple_of": 8}, "global_batch=60 gives each of 1 process.* multiple_of=8 divides; "
                                             "use a global_batch that is a multiple of 8"),
    ({"global_batch": 60, "multiple_of": 0}, "multiple_of must be a positive integer, got 0"),
])
def test_sizes_no_probe_can_serve_are_refused_before_any_trial(tmp_path, monkeypatch, options, message):
    """max_batch=0 was taken for no cap; an impossible global_batch/multiple_of pair was refused
    only after the whole probe, in a message that never named global_batch."""
    no_probe(monkeypatch)
    with pytest.raises(ValueError, match=message):
        fit_batch_size(make_trainer(tmp_path), **options)


def test_the_models_train_and_eval_modes_are_put_back(tmp_path):
    """A model in eval() (one submodule in train()) is as it was after the probe, module by module."""
    trainer = make_trainer(tmp_path)
    trainer.model.eval()
    trainer.model.transformer.h[0].train()
    before = [module.training for module in trainer.model.modules()]
    with simulated_memory(BUDGET):
        fit_batch_size(trainer, strategy="binary", cache=False)
    assert [module.training for module in trainer.model.modules()] == before


def test_probe_options_as_a_dict_is_one_error_naming_the_keywords(tmp_path):
    """AutoBatchSize takes probe_options={...}; fit_batch_size takes them as keywords."""
    with pytest.raises(TypeError, match=r"as keywords .*not as probe_options"):
        fit_batch_size(make_trainer(tmp_path), memory_limit="8MiB", probe_options={"cache": False})


@pytest.mark.parametrize("kind, world, tp, wrapped, expected", [
    ("MULTI_CPU", 2, False, False, "trainable"),  # gloo DDP: buckets as large as the trainable parameters
    ("MULTI_GPU", 2, False, False, 0),  # measured on 2 x H200: the Trainer's DDP step peaks as the unwrapped one
    ("NO", 1, False, False, 0),
    ("FSDP", 2, False, False, 0),  # shards its gradients its own way
    ("DEEPSPEED", 2, False, False, 0),
    ("MULTI_CPU", 2, True, False, 0),  # tensor parallelism: no DDP wrap
    ("MULTI_CPU", 2, False, True, 0),  # already wrapped: measured as it is
])
def test_ddp_buckets_are_held_where_train_will_wrap_the_model_in_gloo_ddp(kind, world, tp, wrapped, expected):
    from autobatch.integrations.transformers_step import ddp_bucket_bytes

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model[0].weight.requires_grad_(False)  # frozen: no bucket slot
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    if wrapped:
        model = torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel)
    accelerator = types.SimpleNamespace(distributed_type=types.SimpleNamespace(name=kind),
                                        parallelism_config=types.SimpleNamespace(tp_enabled=tp))
    trainer = types.SimpleNamespace(accelerator=accelerator, model=model, args=types.SimpleNamespace(world_size=world))
    assert ddp_bucket_bytes(trainer) == (trainable if expected == "trainable" else 0)


def test_a_trial_over_processes_holds_the_buckets_through_its_step(tmp_path, monkeypatch):
    """The stand-in for DDP's buckets is allocated before the step and held through it: a trial's
    peak is the unwrapped step's plus its bytes."""
    from autobatch.integrations import transformers_step

    sample = {"input_ids": [1] * 16}
    peaks = {}
    for held in (0, 3 * 2**20):
        monkeypatch.setattr(transformers_step, "ddp_bucket_bytes", lambda trainer, held=held: held)
        trainer = make_trainer(tmp_path)
        trainer.create_optimizer()
        step = transformers_step.TrainerStep(trainer, sample, None)
        with simulated_memory("1GiB") as memory:
            step(2)  # the optimizer's state, made in the first step
            memory.reset_peak()
            step(2)
            peaks[held] = memory.peak_bytes
    assert peaks[3 * 2**20] - peaks[0] == 3 * 2**20


def test_review36_a_fast_tokenizers_batch_encoding_keeps_its_encodings():
    """A ``BatchEncoding`` from a fast tokenizer was rebuilt from its dict alone, by the split and by
    the move to the device even of a whole batch: ``batch.word_ids(i)`` in the loss raised
    transformers' "word_ids() is not available when using Python based tokenizers". Trained whole,
    then in halves after an OOM: the weights of one step on the whole batch."""
    import copy

    import autobatch
    tokenizers = pytest.importorskip("tokenizers")
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[PAD]": 0, "a": 1, "b": 2, "c": 3}, unk_token="[PAD]"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="[PAD]")
    batch = tokenizer(["a b", "b c a", "c", "a a a", "b", "c c", "a b c a", "b a"], padding=True, return_tensors="pt")
    batch["labels"] = torch.arange(8) % 3
    seen = []

    def loss_fn(model, piece):  # each sample's mean over its words' first tokens
        seen.append(len(piece.encodings or []))
        rows = []
        for i in range(len(piece["labels"])):
            ids = piece.word_ids(i)
            first = [j for j, w in enumerate(ids) if w is not None and (j == 0 or ids[j - 1] != w)]
            rows.append(model(piece["input_ids"][i, first]).mean(0))
        return torch.nn.functional.cross_entropy(torch.stack(rows), piece["labels"])

    torch.manual_seed(0)
    reference = torch.nn.Embedding(4, 3, dtype=torch.float64)
    trained = copy.deepcopy(reference)
    loss_fn(reference, batch).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    runner = autobatch.Runner(trained, torch.optim.SGD(trained.parameters(), lr=0.5), loss_fn, global_batch=8,
                              micro_batch=8, progress=False, grow_after=None, device="cpu")
    autobatch.inject_oom(runner, at=(0, "backward"))
    with simulated_memory("64MiB"):
        runner.fit([batch])
    torch.testing.assert_close(trained.weight, reference.weight, rtol=1e-12, atol=1e-12)
    assert seen == [8, 8, 4, 4]
    assert autobatch.split_batch(batch, 3)[2].word_ids(1) == batch.word_ids(7)


def test_review38_a_batch_of_one_as_sample_is_one_error_before_any_trial(tmp_path, monkeypatch):
    """``sample=tokenizer(text, return_tensors="pt")`` holds ``(1, 40)`` where the set holds lists of
    40: the collator stacked ``(batch, 1, 40)`` and the first trial failed inside the model (a BERT:
    "too many values to unpack (expected 2)"), naming neither ``sample=`` nor what to pass."""
    from autobatch.integrations.transformers_samples import refuse_batched_sample

    no_probe(monkeypatch)
    trainer = make_trainer(tmp_path)
    with pytest.raises(ValueError, match=r"sample= is a batch of one.*'input_ids' has 2 dimensions .* have 1"):
        fit_batch_size(trainer, sample={"input_ids": torch.ones(1, 40, dtype=torch.long)})
    refuse_batched_sample({"input_ids": torch.ones(40, dtype=torch.long)}, trainer.train_dataset)  # one sample
