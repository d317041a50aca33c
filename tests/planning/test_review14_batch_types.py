"""Batch types real training code feeds the runner, cut into micro-batches and re-cut by an OOM
recovery: each sample trained once, the weights those of one step on the whole batch (float64).

Review 14 found a dataclass batch refused ("batch has no tensor with a batch dimension: DC"),
or, beside a tensor that gave the batch's size, shared whole by every micro-batch (each trained
all its samples); a sparse COO tensor failing inside the step (torch's "Could not run
'aten::as_strided'", then "Cannot access storage of SparseTensorImpl" on the simulated device);
a PackedSequence, a nested tensor and a CSR tensor failing with errors that named nothing to
change; and ``DatasetBatches`` iterating a dict sample's batch as its keys.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import autobatch
from autobatch.training.batch_ops import map_tensors
from autobatch.workloads.batches import DatasetBatches, RandomClassification

B, T, V = 8, 5, 11


@dataclasses.dataclass(frozen=True)
class Tokens:
    input_ids: torch.Tensor
    mask: torch.Tensor
    count: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:  # a derived field: it follows the piece, not the whole batch
        object.__setattr__(self, "count", self.input_ids.shape[0])


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.out = nn.Embedding(V, 4, dtype=torch.float64), nn.Linear(4, 3, dtype=torch.float64)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.out((self.embed(ids) * mask[..., None]).sum(1))


def _reference_and_run(batch, loss_fn, model, micro_batch=4, simulated=False):
    """(weights after one SGD step on the whole batch, after the runner's step in pieces of
    ``micro_batch`` replayed in halves after an OOM in the first one's backward, the batches the
    loss saw)."""
    reference, trained = model, copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    loss_fn(reference, batch).backward()
    optimizer.step()
    seen = []
    runner = autobatch.Runner(trained, torch.optim.SGD(trained.parameters(), lr=0.5),
                              lambda m, b: seen.append(b) or loss_fn(m, b), global_batch=B, micro_batch=micro_batch,
                              progress=False, grow_after=None, device="cpu")
    autobatch.inject_oom(runner, at=(0, "backward"))
    if simulated:
        with autobatch.simulated_memory("64MiB"):
            runner.fit([batch])
    else:
        runner.fit([batch])
    for ours, theirs in zip(trained.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    return seen


def _tokens() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, T), generator=generator)
    mask = (torch.rand(B, T, generator=generator) > 0.3).double()
    return ids, mask, torch.randint(0, 3, (B,), generator=generator)


@pytest.mark.parametrize("form", ["root", "in a dict", "beside the labels"])
def test_a_dataclass_batch_is_cut_by_its_fields(form):
    """Refused at the root or in a dict; beside the labels each piece got the whole dataclass:
    every micro-batch's forward ran on all 8 samples (the weights agreed only by luck)."""
    ids, mask, labels = _tokens()
    tokens = Tokens(ids, mask)
    batch = {"root": tokens, "in a dict": {"tokens": tokens, "labels": labels}, "beside the labels": (tokens, labels)}[form]

    def loss_fn(model, b):
        parts, y = (b, labels) if form == "root" else (b["tokens"], b["labels"]) if form == "in a dict" else b
        logits = model(parts.input_ids, parts.mask)
        return logits.pow(2).mean() if form == "root" else nn.functional.cross_entropy(logits, y)

    torch.manual_seed(0)
    seen = _reference_and_run(batch, loss_fn, Bag())
    pieces = [b if form == "root" else b["tokens"] if form == "in a dict" else b[0] for b in seen]
    assert [(type(p), p.input_ids.shape[0], p.count) for p in pieces] == [(Tokens, 4, 4)] + [(Tokens, 2, 2)] * 4
    assert map_tensors(tokens, lambda t: t[:1]).count == 1  # moved to a device as it is cut: rebuilt


def test_a_sparse_coo_batch_trains_on_the_simulated_device():
    generator = torch.Generator().manual_seed(1)
    dense = torch.randn(B, 6, generator=generator, dtype=torch.float64).clamp(min=0)
    target = torch.randn(B, 2, generator=generator, dtype=torch.float64)
    torch.manual_seed(0)
    seen = _reference_and_run((dense.to_sparse(), target), lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
                              nn.Linear(6, 2, dtype=torch.float64), simulated=True)
    assert [piece[0].layout for piece in seen] == [torch.sparse_coo] * 5  # 4, then 2, 2, 2, 2 after the OOM
    assert torch.equal(torch.cat([piece[0].to_dense() for piece in seen[1:]]), dense)


def _packed(x: torch.Tensor) -> object:
    return pack_padded_sequence(x, torch.tensor([5, 4, 4, 3, 3, 2, 2, 1]), batch_first=True)


@pytest.mark.parametrize("kind, said", [
    ("packed", "batch[0] is a PackedSequence: its samples are interleaved in one packed tensor"),
    ("nested", "batch['x'] is a nested tensor, which torch cannot cut along dim 0"),
    ("csr", "batch['x'] is a sparse torch.sparse_csr tensor, which torch cannot cut along dim 0"),
    ("vocabulary mask", "keep a tensor shared by the whole batch (a vocabulary mask, class weights) out of the batch"),
])
def test_what_cannot_be_cut_is_one_error_naming_what_to_pass(kind, said):
    x, y = torch.randn(B, T, 3), torch.randn(B)
    batch = {
        "packed": (_packed(x) if kind == "packed" else None, y),
        "nested": {"x": torch.nested.as_nested_tensor([x[i, :i + 1] for i in range(B)]) if kind == "nested" else None,
                   "y": y},
        "csr": {"x": x[:, 0].relu().to_sparse_csr() if kind == "csr" else None, "y": y},
        "vocabulary mask": {"x": x, "y": y, "vocab": torch.ones(V)},
    }[kind]
    model = nn.Linear(3, 1)
    runner = autobatch.Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m.weight.sum(),
                              global_batch=B, micro_batch=4, progress=False)
    with pytest.raises(ValueError, match="cannot|out of the batch") as raised:
        runner.fit([batch])
    assert said in str(raised.value)
    assert runner.step == 0


def test_a_token_mean_loss_is_exact_as_a_sample_mean_of_token_weighted_sums():
    """docs/runner.md's recipe: a mean over the batch's real tokens, weighted by samples across
    micro-batches, is not the batch's token mean (the pieces hold other token counts); each sample's
    token-loss sum times ``samples / tokens`` of the whole batch (a per-sample field the collate
    adds) is a mean over samples, exact however the batch is cut."""
    ids, mask, _ = _tokens()
    targets = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))
    batch = {"ids": ids, "mask": mask, "targets": targets, "token_weight": torch.full((B,), B / mask.sum().item(), dtype=torch.float64)}
    lm = nn.Sequential(nn.Embedding(V, 4, dtype=torch.float64), nn.Linear(4, V, dtype=torch.float64))

    def per_token(model, b):
        return nn.functional.cross_entropy(model(b["ids"]).transpose(1, 2), b["targets"], reduction="none") * b["mask"]

    def token_mean(model, b):
        return per_token(model, b).sum() / b["mask"].sum()

    def weighted(model, b):
        return (per_token(model, b).sum(1) * b["token_weight"]).mean()

    torch.testing.assert_close(weighted(lm, batch), token_mean(lm, batch), rtol=1e-12, atol=1e-12)
    _reference_and_run(batch, weighted, lm)  # asserts the weights equal a whole-batch token-mean step's
    with pytest.raises(AssertionError):
        _reference_and_run(batch, token_mean, copy.deepcopy(lm))


def test_dataset_batches_collates_dict_samples():
    class Samples(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 5

        def __getitem__(self, index: int) -> dict:
            return {"x": torch.full((3,), float(index)), "label": index, "name": f"s{index}"}

    batch = DatasetBatches(Samples())(3)
    assert batch["name"] == ["s0", "s1", "s2"] and torch.equal(batch["label"], torch.tensor([0, 1, 2]))
    assert isinstance(DatasetBatches(RandomClassification(4, (2,), 3))(2), tuple)


@dataclasses.dataclass(frozen=True)
class Masked:
    input_ids: torch.Tensor
    mask: torch.Tensor | None = dataclasses.field(init=False, default=None)  # the collate sets it after construction


@pytest.mark.parametrize("micro_batch", [B, 4])
def test_review33_a_dataclass_field_set_after_init_reaches_every_piece(micro_batch):
    """An ``init=False`` field the collate sets after construction was not passed to ``__init__`` when
    the batch was rebuilt: every piece, and the move to the device of a batch trained whole, got its
    default (None: "unsupported operand type(s) for *: 'Tensor' and 'NoneType'" inside the loss)."""
    ids, mask, _ = _tokens()
    batch = Masked(ids)
    object.__setattr__(batch, "mask", mask)
    torch.manual_seed(0)
    seen = _reference_and_run(batch, lambda m, b: m(b.input_ids, b.mask).pow(2).mean(), Bag(), micro_batch=micro_batch)
    assert torch.equal(torch.cat([piece.mask for piece in seen[1:]]), mask)  # each sample's own mask, after the OOM


@dataclasses.dataclass
class Scaled:
    pixels: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self) -> None:
        self.pixels = self.pixels / 255  # run again on each rebuilt piece: trained pixels / 255 / 255


def test_review33_a_dataclass_whose_post_init_changes_its_fields_is_one_error():
    """Rebuilt through ``__init__`` for every piece and every move to the device, such a batch trained
    its inputs transformed twice, silently (0.2 off one plain step's weights), even in one micro-batch."""
    batch = Scaled(torch.rand(B, 3) * 255, torch.randint(0, 2, (B,)))
    model = nn.Linear(3, 2)
    runner = autobatch.Runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              lambda m, b: nn.functional.cross_entropy(m(b.pixels), b.labels), global_batch=B,
                              micro_batch=B, progress=False)
    with pytest.raises(ValueError, match=r"dataclass \(Scaled\) whose __init__ / __post_init__ changes .*\(pixels:.*collate_fn"):
        runner.fit([batch])
    assert runner.step == 0


def test_review33_a_batch_of_text_alone_says_what_tensor_to_add():
    """Only strings (texts tokenized in the loss_fn): the error named the type, not what to change."""
    with pytest.raises(ValueError, match=r"no tensor with a batch dimension: dict\. .*torch\.arange\(len\(texts\)\)"):
        autobatch.training.runner.batch_size_of({"text": ["a b", "c"], "lang": "en"})


@dataclasses.dataclass
class Augmented:
    pixels: torch.Tensor
    labels: torch.Tensor
    scale: dataclasses.InitVar[float]

    def __post_init__(self, scale: float) -> None:
        pass


def test_review36_a_dataclass_with_an_initvar_without_default_is_one_error_naming_it():
    """Rebuilt through ``__init__`` for every piece, such a batch raised dataclasses' bare "InitVar 'scale'
    must be specified with replace()", which named neither the batch nor what to change."""
    batch = Augmented(torch.rand(B, 3), torch.randint(0, 2, (B,)), 2.0)
    with pytest.raises(ValueError, match=r"^batch is a dataclass \(Augmented\) with an InitVar .*'scale'.*Make it a field"):
        autobatch.split_batch(batch, 4)


def _labelled() -> dict:
    """A custom collate's batch: features as a tensor, labels and ids as NumPy arrays of the batch's
    length (cut with the samples), and arrays that are not (a class list, a 0-dim scale: shared)."""
    generator = torch.Generator().manual_seed(3)
    return {"x": torch.randn(B, 6, generator=generator, dtype=torch.float64),
            "y": torch.randint(0, 3, (B,), generator=generator).numpy(), "ids": np.arange(B) * 10,
            "classes": np.array(["a", "b", "c"]), "scale": np.array(2.0)}


def _labelled_loss(model, b):
    assert b["classes"].shape == (3,) and float(b["scale"]) == 2.0  # shared whole by every piece
    assert len(b["ids"]) == len(b["y"]) == len(b["x"])  # the piece's samples, each with its own id and label
    return nn.functional.cross_entropy(model(b["x"]) * float(b["scale"]), torch.from_numpy(b["y"]))


def test_review36_numpy_labels_are_cut_with_the_samples_in_an_oom_replay():
    """Shared whole by every micro-batch, a NumPy array of the batch's labels failed the first OOM
    replay's loss ("Expected input batch_size (4) to match target batch_size (8)"): cut along dim 0 now,
    the weights those of one step on the whole batch."""
    batch = _labelled()
    torch.manual_seed(0)
    seen = _reference_and_run(batch, _labelled_loss, nn.Linear(6, 3, dtype=torch.float64), simulated=True)
    assert [len(piece["ids"]) for piece in seen] == [4, 2, 2, 2, 2]  # 4, then halves after the OOM
    assert all(type(piece["ids"]) is np.ndarray and np.shares_memory(piece["ids"], batch["ids"]) for piece in seen)
    assert np.array_equal(np.concatenate([piece["ids"] for piece in seen[1:]]), batch["ids"])


def test_review36_split_batch_accumulate_and_the_planners_batches_cut_numpy_arrays():
    """``split_batch``, ``accumulate_gradients``, the planner's batches (``take_samples``,
    ``cycle_samples``) and a rank's share cut an array as long as the batch; alone it is no size."""
    from autobatch.cli.sharding import take_share
    from autobatch.planning.samples import cycle_samples, take_samples

    batch = _labelled()
    pieces = autobatch.split_batch(batch, 3)
    assert [piece["ids"].tolist() for piece in pieces] == [[0, 10, 20], [30, 40, 50], [60, 70]]
    assert take_samples(batch, torch.tensor([5, 1]), B)["ids"].tolist() == [50, 10]
    assert cycle_samples(batch, B + 2, B)["y"].tolist() == batch["y"].tolist() + batch["y"][:2].tolist()
    assert take_share(batch, 1, 4)["ids"].tolist() == [20, 30]
    model = nn.Linear(6, 3, dtype=torch.float64)
    _labelled_loss(model, batch).backward()
    whole = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    autobatch.accumulate_gradients(model, _labelled_loss, batch, 3)
    for ours, theirs in zip((p.grad for p in model.parameters()), whole):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"no tensor with a batch dimension: dict\. .*NumPy arrays alone"):
        autobatch.split_batch({"ids": np.arange(B)}, 4)
