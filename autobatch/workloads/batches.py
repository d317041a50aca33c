"""Batch makers for a probe or a training loop: ``make(B)`` returns ``(inputs, targets)``.

:class:`SyntheticBatches` draws random data from a spec (shapes, dtype, classes, vocabulary),
so a model can be probed without any data on disk. Variable-length token data draws each
batch's length from ``[min_seq_len, seq_len]`` in training, but with ``worst_case=True`` (the
probe) always uses ``seq_len``: the batch that fits must fit the longest sequences.
:class:`DatasetBatches` collates consecutive samples of a map-style dataset.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils.data import Dataset, default_collate

from .. import checks
from ..training.batch_ops import map_tensors

__all__ = ["SyntheticBatches", "DatasetBatches", "RandomClassification"]


class SyntheticBatches:
    """Random ``(inputs, targets)`` batches on ``device``.

    ``inputs="tensor"``: inputs ``[B, *shape]`` of ``dtype``, targets ``[B]`` classes.
    ``inputs="tokens"``: inputs ``[B, T]`` token ids, targets ``[B, T]`` (next-token labels),
    ``T = seq_len``, or random in ``[min_seq_len, seq_len]`` unless ``worst_case``.
    """

    def __init__(
        self,
        *,
        inputs: str,
        shape: Sequence[int] = (3, 32, 32),
        dtype: torch.dtype = torch.float32,
        num_classes: int = 10,
        seq_len: int = 128,
        min_seq_len: int | None = None,
        vocab_size: int = 1024,
        device: torch.device | str = "cpu",
        worst_case: bool = False,
        seed: int = 0,
    ) -> None:
        if inputs not in ("tensor", "tokens"):
            raise ValueError(f"inputs must be 'tensor' or 'tokens', got {inputs!r}")
        shape = checks.positive_shape("SyntheticBatches shape", shape)
        counts = (("num_classes", num_classes), ("seq_len", seq_len), ("vocab_size", vocab_size))
        num_classes, seq_len, vocab_size = (checks.positive_int(f"SyntheticBatches {name}", n) for name, n in counts)
        if min_seq_len is not None and not 1 <= min_seq_len <= seq_len:
            raise ValueError(f"data.min_seq_len={min_seq_len} must be between 1 and data.seq_len={seq_len}")
        self.inputs = inputs
        self.shape = tuple(shape)
        self.dtype = dtype
        self.num_classes = num_classes
        self.seq_len = seq_len
        self.min_seq_len = min_seq_len
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.worst_case = worst_case
        self.generator = torch.Generator().manual_seed(seed)

    def length(self, generator: torch.Generator | None = None) -> int:
        """The sequence length of the next token batch (drawn from ``generator``, else this
        maker's own)."""
        if self.worst_case or self.min_seq_len is None:
            return self.seq_len
        generator = generator if generator is not None else self.generator
        return int(torch.randint(self.min_seq_len, self.seq_len + 1, (1,), generator=generator))

    def __call__(self, batch_size: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of ``batch_size``; random numbers from ``generator`` (a generator on this
        maker's device) when given, else from torch's global generator."""
        if self.inputs == "tokens":
            size = (batch_size, self.length(generator))
            tokens = torch.randint(0, self.vocab_size, size, device=self.device, generator=generator)
            return tokens, torch.randint(0, self.vocab_size, size, device=self.device, generator=generator)
        x = torch.randn(batch_size, *self.shape, device=self.device, generator=generator).to(self.dtype)
        return x, torch.randint(0, self.num_classes, (batch_size,), device=self.device, generator=generator)


class DatasetBatches:
    """Consecutive samples of a map-style dataset, collated (``default_collate``) and moved to
    ``device``; wraps around at the end. Samples are any structure ``default_collate`` stacks
    (``(input, target)`` pairs, dicts, with strings beside), of equal shapes; every tensor of
    the batch is moved (a dict sample's batch was iterated as its keys: "'str' object has no
    attribute 'to'")."""

    #: The estimate's trace builds its batches for real (:class:`~autobatch.probe.tracing.trace_failures.RealBatches`):
    #: one read per sample, traced, ran operators in proportion to the batch, and the trace stopped there
    #: ("the step's operators grow with its batch"), so a dataset's probe never had an estimate.
    reads_stored_samples = True

    def __init__(self, dataset: Dataset, device: torch.device | str = "cpu") -> None:
        if not hasattr(dataset, "__len__") or len(dataset) == 0:  # type: ignore[arg-type]
            raise ValueError("data.dataset must be a non-empty map-style dataset (with __len__ and __getitem__)")
        self.dataset = dataset
        self.device = torch.device(device)
        self.position = 0

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __call__(self, batch_size: int) -> Any:
        size = len(self)
        samples = [self.dataset[(self.position + i) % size] for i in range(batch_size)]
        self.position = (self.position + batch_size) % size
        batch = default_collate(samples)
        if isinstance(batch, list):  # default_collate's list for tuple samples: the (inputs, targets) tuple
            batch = tuple(batch)
        return map_tensors(batch, lambda tensor: tensor.to(self.device), scalars=True)


class RandomClassification(Dataset):
    """``size`` fixed random samples ``(x of shape, class)``: a stand-in dataset for examples."""

    def __init__(self, size: int, shape: Sequence[int], num_classes: int, seed: int = 0) -> None:
        size = checks.positive_int("RandomClassification size", size)
        shape = checks.positive_shape("RandomClassification shape", shape)
        num_classes = checks.positive_int("RandomClassification num_classes", num_classes)
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(size, *shape, generator=generator)
        self.targets = torch.randint(0, num_classes, (size,), generator=generator)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]
