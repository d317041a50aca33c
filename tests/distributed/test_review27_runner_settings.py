"""``fit()`` agrees the settings that shape an out-of-memory replay across ranks (one process).

Two gloo ranks (by hand) with ``Runner(..., multiple_of=2 if rank == 0 else 1)`` and an OOM on rank
1: rank 0 gave up at its floor (``StepOutOfMemoryError``) while rank 1 waited at the recovery's
sync point ("next micro-batch") until the sync deadline or rank 0's exit, then a
``RankDisagreementError`` naming no setting; ``max_micro_batch=8 if rank == 0 else 2`` with
``grow_after=1`` left both ranks waiting out the deadline (one went back from a grow-back try, the
other proposed a size). Now ``fit()``'s argument agreement names them, before any step. Here a
one-rank group stands in for two ranks: the exchange's second row is a peer's, made up."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autobatch
from one_rank import one_rank_group  # noqa: F401  (a fixture)

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")


def _runner(**options) -> autobatch.Runner:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return autobatch.Runner(model, optimizer, lambda m, b: m(b[0]).pow(2).mean(), global_batch=4, micro_batch=2,
                            distributed=True, progress=False, **options)


def _with_peer(monkeypatch, runner: autobatch.Runner, peer) -> list[list[int]]:
    """Make the runner's ``fit()`` argument exchange see a second rank whose row is ``peer(mine)``;
    returns the rows it saw. The runner's ``_parallel`` is shared (installed once): patched for this test only."""
    exchange, seen = runner._parallel.exchange, []

    def two_ranks(values, label):
        rows = exchange(values, label)
        if label.startswith("fit()"):
            rows = rows + [peer(list(rows[0]))]
            seen.extend(rows)
        return rows

    monkeypatch.setattr(runner._parallel, "exchange", two_ranks)
    return seen


def test_replay_settings_that_differ_between_ranks_are_one_error_naming_them(one_rank_group, monkeypatch):
    runner = _runner(multiple_of=1, max_micro_batch=2, grow_after=5)
    assert runner.distributed
    _with_peer(monkeypatch, runner, lambda row: [value + 1 for value in row])  # every setting differs on "rank 1"
    with pytest.raises(ValueError) as caught:
        runner.fit([(torch.randn(4, 3),)], steps=1)
    message = str(caught.value)
    for part in ("multiple_of: rank 0 1, rank 1 2", "max_micro_batch: rank 0 2, rank 1 3", "grow_after: rank 0 5, rank 1 6",
                 "min_micro_batch: rank 0 1, rank 1 2", "checkpointing_fallback: rank 0 not set, rank 1 set"):
        assert part in message, message
    assert runner.step == 0  # refused before any step


def test_grow_after_zero_and_none_are_the_same_setting(one_rank_group, monkeypatch):
    """``grow_after=0`` and ``None`` both turn grow-back off: a rank with each is no disagreement."""
    off = _runner(grow_after=None)
    theirs = _with_peer(monkeypatch, off, lambda row: row)
    off.fit([(torch.randn(4, 3),)], steps=1)
    monkeypatch.undo()
    runner = _runner(grow_after=0)
    _with_peer(monkeypatch, runner, lambda row: list(theirs[0]))
    result = runner.fit([(torch.randn(4, 3),)], steps=1)
    assert result.steps == 1


def test_review36_a_model_that_differs_between_ranks_is_one_error_before_any_collective(one_rank_group, monkeypatch):
    """A plain module built another width on rank 1 (a config read per rank): the first broadcast and the
    gradient all-reduce paired other sizes, and gloo aborted rank 0 (SIGABRT, ``op.preamble.length <=
    op.nbytes``) while rank 1 raised a ``RankDisagreementError`` naming no cause (2 gloo ranks, by hand).
    Now ``fit()`` compares the parameters' layout first: one ``ValueError`` naming each rank's."""
    runner = _runner()
    exchange, labels = runner._parallel.exchange, []

    def two_ranks(values, label):
        labels.append(label)
        rows = exchange(values, label)
        peer = list(rows[0])
        if label == "every rank's model (parameters, shapes, dtypes)":
            peer[1] += 1  # one more value on "rank 1"
        return rows + [peer]

    monkeypatch.setattr(runner._parallel, "exchange", two_ranks)
    with pytest.raises(ValueError, match=r"model differs between ranks \(rank 0: 2 parameter tensors, 4 values; "
                                         r"rank 1: 2 parameter tensors, 5 values\).*same model"):
        runner.fit([(torch.randn(4, 3),)], steps=1)
    assert runner.step == 0 and labels[-1] == "every rank's model (parameters, shapes, dtypes)"  # before the weights' broadcast
