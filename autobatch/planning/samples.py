"""Batches of any size built from the samples of one: the planner's, the runner's and a probe's.

A probe trial needs a batch of every size it tries; the runner plans on its first global
batch, and a trial larger than it goes round it again. :func:`map_samples` applies one function
to every batched tensor and another to every list of per-sample values (file names, raw text,
per-sample dicts), keeping the batch's structure; :func:`take_samples` picks given samples, and
:func:`cycle_samples` the first ``n`` round and round by slicing, which fake tensors can trace
(the ``estimate`` strategy builds its batches under them, and they cannot read an index back).

What is per sample follows what ``DataLoader``'s ``default_collate`` builds, and the custom
collates beside it (a detection collate's tuple of per-sample dicts, a list of variable-length
token lists); the rule, in ``docs/runner.md`` ("What a batch may hold"):

* a tensor with a dimension is split along dim 0 (a sparse COO one too); a 0-dim tensor, a
  number, a string, ``None`` are shared by every micro-batch; a NumPy array with a dimension as
  long as the batch (a custom collate's ids or labels) is cut along dim 0 with the samples, by
  ``values`` (a piece's view, picked rows, of its type: :func:`~.batch_nodes.picked`), another
  shared (it never sets the batch's size: a batch of NumPy arrays alone has none); dicts, named tuples and
  dataclasses hold fields, each read by this rule;
* what cannot be cut along dim 0 is one error naming its place and what to pass instead: a
  ``PackedSequence`` (its samples interleaved in one tensor), a nested tensor, a sparse
  CSR/CSC/BSR/BSC tensor (:func:`check_cuttable`);
* a list or tuple holding tensors or dicts holds the batch's *fields* (default_collate's
  ``(inputs, targets)``, each split) where their tensors all have the batch's samples on dim 0,
  else *one entry per sample* (split as a list) where it has one entry per sample, else it is
  one error naming it; the batch itself is always fields. One as long as the batch beside a
  sibling that only one entry per sample fits (a ``tuple(zip(*batch))`` collate's images beside
  its target dicts), or beside per-sample values of its length (labels, captions: a zip's every
  part is) is per sample too, whatever its tensors' dim 0 (:func:`_zipped`, :func:`_transposed`);
* a list or tuple of plain values (strings, objects, token lists) is one entry per sample when
  it is as long as the batch and shared otherwise, but for default_collate's transposed text
  (a list of per-sample tuples of strings, each as long as the batch, split one by one);
* numbers: a tuple of them is a constant (an image's ``(H, W)``), shared whatever its length
  (reading it by its length split ``(32, 48)`` when a batch had 2 samples), but for one as long
  as the batch in a (named) tuple or list of a zip collate (its ids, labels); a list of them as
  long as the batch is an error, for it could be either (default_collate makes per-sample
  numbers a tensor: do so, and make a constant a tuple).

:func:`batch_size_of` reads the batch's size by the same rule, so a list of per-sample dicts
holding tensors of their own sizes (detection boxes) is no disagreement on dim 0. A batch that
is itself a list of per-sample items of one form (``DataLoader(collate_fn=list)``: ``(x, y)``
tuples) would read as the size of one item's parts; where no tensor has the samples on dim 0
it is one error naming the forms to pass instead (:func:`per_sample_items`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping

import torch
from torch.nn.utils.rnn import PackedSequence

from .batch_nodes import (children_of, is_dataclass_instance, is_named, is_ndarray, is_number, is_plain, leaf_sizes,
                          picked)
from .dataclass_batches import rebuilt
from .mapping_batches import rebuilt_mapping

__all__ = ["spread_indices", "batch_size_of", "check_cuttable", "cycle_samples", "items_message", "map_samples", "narrow",
           "per_sample_items", "take_samples"]

# layouts with no dim-0 slicing or index_select on them (torch 2.x): CSR's "do not have strides"
_UNCUT_LAYOUTS = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def take_samples(batch: Any, index: torch.Tensor, total: int) -> Any:
    """The samples ``index`` of ``batch`` (of ``total`` samples): tensors and per-sample lists
    alike (:func:`map_samples`); a planner's or a probe's batch of any size built from one.
    The index is read back to the host only for a list of per-sample values (a fake index
    cannot be; tensors are picked with ``index_select``)."""
    picks: list[int] = []

    def values(found: Any) -> Any:
        if not picks:
            picks.extend(index.tolist())
        return picked(found, picks)

    return map_samples(batch, lambda t: t.index_select(0, index.to(t.device)), values, total)


def cycle_samples(batch: Any, size: int, total: int) -> Any:
    """The first ``size`` samples of ``batch`` (of ``total`` samples), round it again past its
    end: sample ``i`` is sample ``i % total``, as ``take_samples(batch, torch.arange(size) %
    total, total)``, but cut and concatenated (a new tensor, as ``index_select`` gives), with no
    index tensor, so it builds the same batch under fake tensors, per-sample lists included."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive integer (the samples to take), got {size!r}")
    rounds, rest = divmod(size, total)

    def tensors(tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([tensor] * rounds + ([narrow(tensor, 0, rest)] if rest else []))

    return map_samples(batch, tensors, lambda found: picked(found, [i % total for i in range(size)]), total)


def batch_size_of(batch: Any) -> int:
    """The number of samples in ``batch``: dim 0 of its tensors, those in a list of per-sample
    entries aside (that list's length counts); one ``ValueError`` naming the tensors where they
    disagree, or where there is none with a batch dimension; what cannot be cut along dim 0 is
    refused first (:func:`check_cuttable`)."""
    check_cuttable(batch)
    sizes = _fields(batch)
    if _items(batch, sizes):
        raise ValueError(items_message(batch, sizes))
    if sizes is None:
        raise ValueError(f"batch has no tensor with a batch dimension: {type(batch).__name__}. autobatch reads the samples "
                         "from tensors' dim 0; strings, objects or NumPy arrays alone may be per sample or shared. "
                         "Add a tensor with the samples on dim 0 (the labels, or their indices: torch.arange(len(texts)))")
    if len(sizes) == 1:
        return next(iter(sizes))
    found = ", ".join(f"{path} has {size}" for path, size in leaf_sizes(batch, "batch")[:6])
    if sizes:  # a list of tensors or dicts, read as fields or one entry per sample, fits several sizes
        raise ValueError(
            f"cannot tell the batch's size: it fits {' or '.join(map(str, sorted(sizes)))} samples (dim 0: {found}), "
            "for a list or tuple of tensors or dicts holds the batch's fields where their dim 0 is the batch's size, "
            "and one entry per sample where it has one per sample. Add a tensor with the batch's samples on dim 0 "
            "(the labels, the samples' indices); see 'What a batch may hold' in docs/runner.md"
        )
    raise ValueError(
        f"batch tensors disagree on dim 0 (the batch dimension): {found}. Every tensor needs the batch's samples on "
        "dim 0, but those in a list or tuple with one entry per sample (per-sample tensors or dicts, as a detection "
        "collate makes): make a sequence-first tensor batch-first (.transpose(0, 1)), one with k rows per sample "
        "(pixel_values of B * k images) [B, k, ...] (.view(B, k, *rest)), and keep a tensor shared by "
        "the whole batch (a vocabulary mask, class weights) out of the batch (on the model, or in the loss_fn's "
        "closure): autobatch cannot tell it from a per-sample one. Rows that are not samples at all (a graph built "
        "from the samples: its nodes and edge list; nn.EmbeddingBag's flat ids with offsets) cannot be cut: pad them "
        "per sample ([B, L] ids with padding_idx) or yield (the per-sample items as a list, a tensor with the "
        "samples on dim 0) and collate them in the loss_fn; see 'What a batch may hold' in docs/runner.md"
    )


def narrow(tensor: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """``tensor``'s samples ``start`` to ``start + length`` (dim 0): a view, or for a sparse COO
    tensor, which has no views (``narrow`` raised torch's "Could not run 'aten::as_strided'"), a copy."""
    if tensor.layout == torch.sparse_coo:
        return tensor.narrow_copy(0, start, length)
    return tensor.narrow(0, start, length)


def check_cuttable(batch: Any, path: str = "batch") -> None:
    """One ``ValueError`` naming the first part of ``batch`` that cannot be cut along dim 0, and
    what to pass instead: a ``PackedSequence`` (read as a named tuple, its packed data's dim 0
    counts tokens: "batch tensors disagree"), a nested tensor or a sparse CSR/CSC/BSR/BSC tensor
    (torch's own errors from inside the step: "NestedTensorImpl doesn't support sizes")."""
    if isinstance(batch, PackedSequence):
        raise ValueError(
            f"{path} is a PackedSequence: its samples are interleaved in one packed tensor, which autobatch cannot cut "
            "into micro-batches. Pass the padded batch-first tensor and the lengths as a tensor (the collate's "
            "pad_sequence(..., batch_first=True), torch.tensor(lengths)) and pack them in the loss_fn "
            "(torch.nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False))")
    if isinstance(batch, torch.Tensor):
        kind = "nested" if batch.is_nested else f"sparse {batch.layout}" if batch.layout in _UNCUT_LAYOUTS else None
        if kind is not None:
            raise ValueError(
                f"{path} is a {kind} tensor, which torch cannot cut along dim 0 (the batch's samples), so autobatch "
                "cannot split it into micro-batches. Pass a padded dense tensor with a mask, a sparse COO tensor "
                "(.to_sparse_coo()), or a list of the samples' tensors beside a tensor with the batch's samples on "
                "dim 0; see 'What a batch may hold' in docs/runner.md")
        return
    for key, value in children_of(batch, path):
        check_cuttable(value, key)


def per_sample_items(batch: Any) -> bool:
    """Whether ``batch`` may be a list of per-sample items, as ``collate_fn=list`` (or ``lambda
    samples: samples``) makes: a list (a collate's own structure is a tuple or a dict) of at least
    two entries of one form, each a list, tuple or dict (a sample's ``(x, y)``) or a tensor (a
    sample's token ids), alike down to their tensors' shapes and dtypes. Read as the batch's
    fields, such a list has the size of one sample's parts (2 for ``(x, y)``, a sequence's length),
    not its entries' count; :func:`batch_size_of` refuses it where no tensor has the samples on dim
    0, and the runner where it has as many entries as its global batch but reads otherwise."""
    if not isinstance(batch, list) or len(batch) < 2:
        return False
    first = _form(batch[0], shape=True)
    return first[0] in ("seq", "map", "tensor") and all(_form(entry, shape=True) == first for entry in batch[1:])


def items_message(batch: list, sizes: frozenset[int] | None, expected: int | None = None) -> str:
    """The one error for a list of per-sample items (:func:`per_sample_items`): what it is read
    as (beside the ``expected`` samples, where known), and the two forms that say what the
    samples are."""
    read = (f"which reads as {' or '.join(map(str, sorted(sizes)))} samples (read from the entries' own lengths or "
            "dim 0)"
            if sizes else "whose entries' tensors do not agree on a batch dimension")
    if expected is not None:
        read = f"as many as the global batch's {expected} samples, {read}"
    return (
        f"batch is a list of {len(batch)} entries of one form ({type(batch[0]).__name__}), {read}: it looks like "
        "per-sample items, as DataLoader(collate_fn=list) or `lambda samples: samples` gives, which autobatch "
        "cannot split without knowing where the samples are. Collate them (the default collate_fn, "
        "torch.utils.data.default_collate: tensors with the samples on dim 0), or pass a (list, tensor) batch: the "
        "per-sample items as one list beside a tensor with the batch's samples on dim 0 (the labels, the samples' "
        "indices); see 'What a batch may hold' in docs/runner.md"
    )


def _items(batch: Any, sizes: frozenset[int] | None) -> bool:
    """A list of per-sample items whose size comes only from its entries' own lengths: none of
    its tensors is read with the batch's samples on dim 0 (or they agree on no size at all)."""
    if not per_sample_items(batch) or isinstance(batch[0], torch.Tensor):
        return False  # a list of tensors with one dim 0 reads as fields: the runner checks its count
    if not sizes:
        return sizes is not None  # disagreeing tensors: the same error; no tensor at all: that error
    if len(sizes) > 1:
        return True
    batched: list[torch.Tensor] = []
    map_samples(batch, lambda tensor: batched.append(tensor) or tensor, lambda values: values, next(iter(sizes)))
    return not batched


def _form(node: Any, shape: bool = False) -> tuple:
    """What a per-sample item looks like, to compare with the others: its kind, and its parts'
    forms down to each tensor's dimensions and dtype. A tensor item's whole ``shape`` counts (a
    list of fields ``[inputs, targets]`` differs there); an item's parts may differ in size (a
    sequence's length, an image's)."""
    if isinstance(node, torch.Tensor):
        return ("tensor", tuple(node.shape) if shape else node.dim(), node.dtype)
    if isinstance(node, Mapping) or is_dataclass_instance(node):
        return ("map", type(node), tuple((key, _form(value)) for key, value in children_of(node, "")))
    if isinstance(node, (list, tuple)):
        return ("seq", type(node), tuple(_form(value) for value in node))
    return ("value", type(node))


def map_samples(batch: Any, tensors: Callable[[torch.Tensor], torch.Tensor], values: Callable[[Any], Any],
                total: int) -> Any:
    """``batch`` (of ``total`` samples) with ``tensors`` applied to each tensor with a batch
    dimension and ``values`` to each list or tuple of per-sample entries, and each NumPy array as
    long as the batch (slice it, or pick with :func:`~.batch_nodes.picked`), keeping its structure;
    other leaves and 0-dim tensors are kept as they are. What is per sample: the module's rule.
    A list or tuple that fits it neither way is one ``ValueError`` naming its path."""
    return _map(batch, "batch", tensors, values, total, root=True)


def _map(node: Any, path: str, tensors: Callable, values: Callable, total: int, root: bool = False,
         zipped: str | None = None) -> Any:
    """``node`` mapped by the module's rule; ``zipped``: a sibling of ``node`` is one entry per sample
    and nothing else (:func:`_zipped`), so ``node``, as long as the batch, is per sample too; where
    their parent is a tuple or list (``"seq"``: a ``tuple(zip(*batch))``, every part transposed), a
    tuple of numbers too (the samples' ``image_id``, not a constant ``(H, W)``)."""
    if isinstance(node, torch.Tensor):
        return tensors(node) if node.dim() > 0 else node
    if is_ndarray(node):  # samples on dim 0 where as long as the batch (ids, labels), as a tensor's; else shared
        return values(node) if node.ndim and len(node) == total else node
    if isinstance(node, Mapping):
        zipped = _zipped(node.values(), total, "map")
        items = {key: _map(value, f"{path}[{key!r}]", tensors, values, total, zipped=zipped) for key, value in node.items()}
        return rebuilt_mapping(node, items, lambda found: values(found) if len(found) == total else None)
    if is_dataclass_instance(node):  # rebuilt through its __init__ (and __post_init__), as dataclasses.replace does
        zipped = _zipped((getattr(node, field.name) for field in dataclasses.fields(node) if field.init), total, "map")
        return rebuilt(node, lambda name, value: _map(value, f"{path}.{name}", tensors, values, total, zipped=zipped), path)
    if is_named(node):
        zipped = _zipped(node, total, "seq")  # a tuple: Batch(*zip(*samples)) is a zip collate's too
        return type(node)(*(_map(value, f"{path}.{name}", tensors, values, total, zipped=zipped)
                            for name, value in zip(node._fields, node)))
    if not isinstance(node, (tuple, list)) or not node:
        return node
    if is_plain(node):
        if zipped == "seq" and len(node) == total and all(is_number(value) for value in node):
            return values(node)  # a zip collate's per-sample numbers: shared, each piece paired them with others
        return _map_plain(node, path, values, total)
    fields = _fields(node)
    if zipped and not root and len(node) == total:
        return values(node)  # beside a per-sample sibling: 3 RGB images [3, H, W] in a batch of 3 are 3 samples
    if root or (fields is None and len(node) != total) or (fields is not None and total in fields):
        zipped = _zipped(node, total, "seq")
        return type(node)(_map(value, f"{path}[{index}]", tensors, values, total, zipped=zipped)
                          for index, value in enumerate(node))
    if len(node) == total:
        return values(node)  # one entry per sample: per-sample dicts, tensors of their own sizes
    found = ", ".join(f"{where} has {size}" for where, size in leaf_sizes(node, path)[:4])
    raise ValueError(
        f"{path} is a {type(node).__name__} of {len(node)} entries in a batch of {total} samples, and its tensors do "
        f"not all have {total} on dim 0 ({found}): it is neither the batch's fields (each split along dim 0) nor one "
        f"entry per sample. Give its tensors the batch's samples on dim 0, or make it a list of {total} per-sample "
        "entries (tensors or dicts); see 'What a batch may hold' in docs/runner.md"
    )


def _zipped(parts: Iterable[Any], total: int, kind: str) -> str | None:
    """Whether one of ``parts`` (the fields of one container) is a list or tuple of ``total``
    tensors or dicts that only one entry per sample fits: its tensors do not all have ``total`` on
    dim 0 (a detection collate's per-sample target dicts, boxes [N_i, 4]). default_collate stacks
    every tensor, so such a part comes from a collate that transposes per-sample tuples
    (torchvision's ``tuple(zip(*batch))``), and its siblings as long as the batch are per sample
    too, even where each of their tensors has ``total`` on dim 0: 3 RGB images of a batch of 3,
    which read as fields were cut along their channels while their targets were cut by sample.
    Returns ``kind`` (the parent's: ``"seq"`` or ``"map"``) where so or :func:`_transposed`, else None."""
    parts = list(parts)
    if _transposed(parts, numbers=kind == "seq") == total:
        return kind
    for part in parts:
        if isinstance(part, (list, tuple)) and not is_named(part) and len(part) == total and part and not is_plain(part):
            fields = _fields(part)
            if fields is None or total not in fields:
                return kind
    return None


def _transposed(parts: list, numbers: bool) -> int | None:
    """The samples of ``parts`` where they are a ``tuple(zip(*samples))``: all lists or tuples of
    one length, one holding tensors or dicts (images: as fields, B RGB images [3, H, W] read as 3
    samples) and one per-sample values (captions, token lists; labels where ``numbers``: a tuple's
    parts, for a dict's (H, W) stays a constant) that read as shared beside fields."""
    if len(parts) < 2 or not all(isinstance(part, (list, tuple)) and not is_named(part) and part for part in parts):
        return None
    if len({len(part) for part in parts}) > 1 or all(is_plain(part) for part in parts):
        return None
    return len(parts[0]) if any(_per_sample(part, numbers) for part in parts) else None


def _per_sample(part: list | tuple, numbers: bool) -> bool:
    """Strings, token lists (not default_collate's transposed text) or ``numbers`` (0-dim tensors too)."""
    return (all(isinstance(value, (str, bytes)) for value in part)
            or all(isinstance(value, (list, tuple)) and all(map(is_number, value)) for value in part)
            or (numbers and all(is_number(value) or isinstance(value, torch.Tensor) and not value.dim() for value in part)))


def _map_plain(node: list | tuple, path: str, values: Callable, total: int) -> Any:
    """A list or tuple of plain values (no tensor, no mapping in it), by the module's rule."""
    if all(isinstance(value, (list, tuple)) and len(value) == total
           and all(isinstance(text, (str, bytes)) for text in value) for value in node):
        return type(node)(values(value) for value in node)  # default_collate's transposed per-sample text
    if len(node) != total:
        return node  # not one entry per sample: shared
    if all(is_number(value) for value in node):
        if isinstance(node, tuple):
            return node  # (H, W): a constant, whatever the batch's size
        raise ValueError(
            f"{path} is a list of {total} numbers in a batch of {total} samples: autobatch cannot tell one number per "
            "sample (split with the batch) from one value for the whole batch (shared). Make per-sample numbers a "
            "tensor, torch.tensor(...), as DataLoader's default collate does, and a constant a tuple"
        )
    return values(node)  # strings, objects, token lists: one per sample


def _fits(node: Any) -> frozenset[int] | None:
    """The batch sizes ``node`` is consistent with (None: any): a tensor's dim 0; a list or tuple
    of tensors or dicts, as the batch's fields or as one entry per sample."""
    if isinstance(node, torch.Tensor):
        return frozenset({node.shape[0]}) if node.dim() > 0 else None
    if isinstance(node, (list, tuple)) and not is_named(node):
        if not node or is_plain(node):
            return None
        fields = _fields(node)
        return None if fields is None else fields | {len(node)}
    return _fields(node) if isinstance(node, (Mapping, tuple)) or is_dataclass_instance(node) else None


def _fields(node: Any) -> frozenset[int] | None:
    """The batch sizes ``node``'s fields agree on (None: any; empty: none)."""
    if isinstance(node, (Mapping, list, tuple)) or is_dataclass_instance(node):
        parts = [value for _, value in children_of(node, "")]
        transposed = _transposed(parts, numbers=isinstance(node, (list, tuple)))
        return frozenset({transposed}) if transposed else _meet(_fits(value) for value in parts)
    return _fits(node)


def _meet(options: Iterable[frozenset[int] | None]) -> frozenset[int] | None:
    met = None
    for option in options:
        if option is not None:
            met = option if met is None else met & option
    return met


def spread_indices(length: int, count: int) -> list[int]:
    """Up to ``count`` indices spread evenly over ``range(length)``, its first and last among them: the
    samples a check reads to tell whether a dataset's samples vary in size, without reading them all
    (the command line's :mod:`~autobatch.cli.dataset_shapes`, Lightning's
    :mod:`~autobatch.integrations.lightning_longest`)."""
    return sorted({index * (length - 1) // (count - 1) for index in range(count)}) if length > 1 else list(range(length))
