"""``find_max_batch`` under ``torch.distributed`` agrees its search-shaping arguments first (one process).

By hand on two gloo ranks (a DDP model, ``memory_limit`` 8 MiB on one rank): ``max_batch``,
``strategy`` or ``multiple_of`` that differ between ranks met at different trials' sync points
(a ``RankDisagreementError`` naming batch sizes, not the argument), and ``margin=0.1`` on rank 0
only left rank 0 verifying the reduced size inside DDP's buckets while rank 1 had finished, both
waiting out the sync deadline. Now one ``ValueError`` on every rank names the argument before the
first trial. Here the collective agreement runs in one process; its exchange is made up to carry a
second rank's row, recorded from a call with the peer's arguments."""

from __future__ import annotations

import pytest
import torch

import autobatch
from autobatch.dist import agreement as dist_sync
from autobatch.dist.probe import CollectiveProbeAgreement
from autobatch.probe import ranks as probe_ranks

LABEL = "probe: every rank's arguments"


class _Stop(Exception):
    """Raised by the made-up exchange at the first sync point after the arguments' agreement."""


def _as_two_ranks(monkeypatch, peer: list[int] | None) -> list[list[int]]:
    """The probe's agreement as under two ranks: the arguments' exchange returns this rank's row
    and ``peer`` (None: this rank's again); any later sync point stops the probe with
    :class:`_Stop`. Returns the rows this rank sent there."""
    sent = []

    def exchange(values, label):
        if label != LABEL:
            raise _Stop(label)
        sent.append(list(values))
        return [list(values), list(values) if peer is None else peer]

    monkeypatch.setattr(dist_sync, "exchange", exchange)
    monkeypatch.setattr(probe_ranks, "current", lambda: CollectiveProbeAgreement())
    return sent


def _probe(**options):
    model = torch.nn.Linear(4, 2)
    step = autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               lambda m, b: m(b).pow(2).mean(), lambda n: torch.randn(n, 4))
    return autobatch.find_max_batch(step, max_batch=64, memory_limit="4MiB", cache=False, **options)


def test_a_margin_and_strategy_that_differ_between_ranks_are_one_error_naming_them(monkeypatch):
    peer = _as_two_ranks(monkeypatch, None)
    with pytest.raises(_Stop):  # the same arguments on both: on to the next sync point
        _probe(margin=0.1, strategy="power")
    monkeypatch.undo()
    _as_two_ranks(monkeypatch, peer[0])
    with pytest.raises(ValueError) as caught:  # before any other sync point (that would raise _Stop)
        _probe(margin=0.0, strategy="binary")
    message = str(caught.value)
    assert "find_max_batch was called with other arguments on other ranks" in message
    assert "margin: rank 0 0.0, rank 1 0.1" in message and "strategy: rank 0 'binary', rank 1 'power'" in message, message
    assert "max_batch" not in message.split("(")[1].split(")")[0]  # only what differs is named
