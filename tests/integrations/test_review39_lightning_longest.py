"""Review 39: ``AutoBatchSize`` probed the train dataloader's first batch, repeated to each size, so a
loader of variable-length samples padded to the longest in the batch was probed at whatever length
that batch drew (shuffled, short): under 8 MiB the probe answered 168 and the confirmation, meeting
longer batches, gave up with ``MemoryError``. The probe now repeats the set's longest sample beside
its shortest, collated by the loader's ``collate_fn`` (``autobatch.integrations.lightning_longest``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from autobatch import simulated_memory  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402
from autobatch.integrations.lightning_longest import PEEK  # noqa: E402
from autobatch.integrations.lightning_step import first_batch  # noqa: E402

SAMPLES, LONGEST = 400, 512


def lengths() -> list[int]:
    """Mostly 8-63 tokens, 1 in 100 long, the longest 512 (near the end: no first batch holds it)."""
    g = torch.Generator().manual_seed(0)
    found = torch.randint(8, 64, (SAMPLES,), generator=g)
    found[::100] = 300
    found[-3] = LONGEST
    return [int(n) for n in found]


def pad(samples):
    ids = torch.zeros(len(samples), max(len(s) for s in samples), dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, :len(s)] = s
    return ids


class Tokens(pl.LightningModule):
    def __init__(self, data, shuffle=True) -> None:
        super().__init__()
        self.batch_size, self.data, self.shuffle = 2, data, shuffle
        torch.manual_seed(0)
        self.emb, self.out = nn.Embedding(100, 16), nn.Linear(16, 100)

    def training_step(self, ids, index):
        return nn.functional.cross_entropy(self.out(self.emb(ids)).flatten(0, 1), ids.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size, shuffle=self.shuffle, collate_fn=pad)


def data():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 100, (n,), generator=g) for n in lengths()]


def trainer(*callbacks, **options):
    return pl.Trainer(callbacks=list(callbacks), accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **options)


def test_review39_the_answer_trains_the_batch_of_the_longest_samples():
    samples = data()
    module, finder = Tokens(samples), AutoBatchSize(confirm=False, strategy="binary")
    torch.manual_seed(0)
    with simulated_memory("2MiB"):
        trainer(finder, max_steps=1).fit(module)
        # the same answer, the samples sorted longest-first: the first batch holds the longest
        longest_first = Tokens(sorted(samples, key=len, reverse=True), shuffle=False)
        longest_first.batch_size = finder.batch_size
        trainer(max_steps=1).fit(longest_first)  # the first batch's answer, 38, ran out of memory in fit itself
    assert 1 < finder.batch_size < 16, finder.batch_size


def test_review39_the_probed_batch_is_padded_to_the_longest_and_fixed_sizes_are_only_peeked_at():
    batch = first_batch(trainer(), Tokens(data()), 1)[0]
    assert batch.shape == (2, LONGEST), batch.shape  # the first batch's own length before (63 at most)

    class Counted(torch.utils.data.Dataset):
        reads = 0

        def __len__(self):
            return 10_000

        def __getitem__(self, index):
            Counted.reads += 1
            return torch.full((8,), index % 100)

    batch = first_batch(trainer(), Tokens(Counted(), shuffle=False), 1)[0]
    assert batch.shape == (2, 8) and Counted.reads <= PEEK + 2, (batch.shape, Counted.reads)


def test_review39_a_collate_fn_that_cannot_pad_gets_the_longest_sample_twice():
    """torch's default collate cannot stack two lengths (a loader whose sampler orders by length
    trains with it): the probed batch is the longest sample twice, as long, not an error."""
    from torch.utils.data import DataLoader

    from autobatch.integrations.lightning_longest import longest_batch

    data = [torch.ones(3 + i % 8) for i in range(100)]
    loader = DataLoader(data, batch_size=4)
    assert longest_batch(loader, None).shape == (2, 10)
