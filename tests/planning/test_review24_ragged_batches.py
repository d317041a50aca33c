"""Batches whose rows are not samples (review 24): a graph collate's nodes and edge list built from n
samples, and an ``nn.EmbeddingBag`` recommender's flat ids with offsets.

plan() of such a batch (planning more than one micro-batch) and ``Runner.fit`` refused it with advice for other
shapes (transpose a sequence-first tensor, view ``[B * k]`` rows as ``[B, k]``, move a shared tensor out), none of
which a graph or a bag of ids can follow. The message now names them and the two forms that split: padded
per-sample rows, or the per-sample items in a list beside a per-sample tensor, collated in the loss_fn.
"""

from __future__ import annotations

import pytest
import torch

from autobatch import batch_size_of, split_batch


def _graph(n: int):
    """n graphs of 6 nodes and 12 edges as one: node features, edge list, node -> graph, labels."""
    edges = torch.randint(0, 6 * n, (2, 12 * n))
    return torch.randn(6 * n, 8), edges[0], edges[1], torch.arange(n).repeat_interleave(6), torch.randint(0, 2, (n,))


def _bag(n: int):
    """EmbeddingBag's flat ids and offsets (3 ids per sample), and the targets."""
    return torch.randint(0, 100, (3 * n,)), torch.arange(n) * 3, torch.rand(n)


@pytest.mark.parametrize("make_batch", [_graph, _bag], ids=["graph", "embedding_bag"])
def test_a_batch_whose_rows_are_not_samples_is_told_the_forms_that_split(make_batch):
    with pytest.raises(ValueError, match="disagree on dim 0") as caught:
        batch_size_of(make_batch(8))
    message = str(caught.value)
    assert "EmbeddingBag" in message and "edge list" in message
    assert "padding_idx" in message and "collate them in the loss_fn" in message


def test_the_forms_the_message_gives_split_into_the_samples():
    """Padded ids ``[B, L]`` (``padding_idx``) and ``(per-sample items, labels)`` are both read as 8 samples."""
    padded = (torch.randint(0, 100, (8, 5)), torch.rand(8))
    items = ([{"x": torch.randn(6, 8), "edges": torch.randint(0, 6, (2, 12))} for _ in range(8)], torch.rand(8))
    for batch in (padded, items):
        assert batch_size_of(batch) == 8
        assert [batch_size_of(piece) for piece in split_batch(batch, 3)] == [3, 3, 2]
