"""Every rank takes the same branch of an out-of-memory recovery, to the same micro-batch.

Found by hand with two gloo ranks given ``micro_batch=4 if rank == 0 else 2`` (``micro_batch``
is per rank) and an injected OOM: with no measured figures each rank halved its own micro-batch,
so the ranks stayed apart; the rank that reached ``min_micro_batch`` first gave up at its floor
(``StepOutOfMemoryError``, or turned on checkpointing) while its peer proposed a size at the
recovery's sync point and waited there until the sync deadline. Now every distributed recovery is
one vote (``autobatch.training.oom.recovery_vote``). Here a one-rank gloo group stands in for two
ranks: the vote's second row is a peer's, made up from this rank's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autobatch
from autobatch import FaultInjector, StepOutOfMemoryError
from one_rank import one_rank_group  # noqa: F401  (a fixture)
from runner_workloads import make_data, make_model, mse

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
VOTE = "next micro-batch"


def _runner(faults=None, micro_batch: int = 8, **options) -> autobatch.Runner:
    model = make_model()
    return autobatch.Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16,
                            micro_batch=micro_batch, distributed=True, progress=False, log_every=None, grow_after=None,
                            faults=faults, **options)


def _with_peer(monkeypatch, runner: autobatch.Runner, peer) -> list[list[list[int]]]:
    """The recovery's vote sees a second rank whose row is ``peer(mine)``; returns every vote's rows."""
    exchange, votes = runner._parallel.exchange, []

    def two_ranks(values, label):
        rows = exchange(values, label)
        if label.endswith(VOTE):
            rows = rows + [peer(list(rows[0]))]
            votes.append(rows)
        return rows

    monkeypatch.setattr(runner._parallel, "exchange", two_ranks)
    return votes


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [param.detach().clone() for param in model.parameters()]


def test_an_unmeasured_recovery_takes_the_smallest_proposal_on_every_rank(one_rank_group, monkeypatch):
    reference = _runner()
    reference.fit(make_data(), epochs=1)
    runner = _runner(FaultInjector([(1, "forward")]))
    votes = _with_peer(monkeypatch, runner, lambda row: [2, 0, 0, 0, 0])  # the peer, at 4, ran out: half of it
    result = runner.fit(make_data(), epochs=1)
    assert len(votes) == 1 and votes[0][0][:2] == [4, 0]  # this rank: half of 8, no figures
    assert [(r["action"], r["micro_batch"]) for r in result.oom_recoveries] == [("halve", 2)]  # not its own 4
    assert result.micro_batch == 2 and result.steps == 3
    for mine, theirs in zip(_weights(runner.model), _weights(reference.model)):  # the same update, replayed
        torch.testing.assert_close(mine, theirs)


def test_a_peer_out_of_options_ends_the_step_on_this_rank_too(one_rank_group, monkeypatch):
    runner = _runner(FaultInjector([(1, "forward")]))
    votes = _with_peer(monkeypatch, runner, lambda row: [1, 0, 1, 1, 0])  # at its floor, no fallback: it gives up
    with pytest.raises(StepOutOfMemoryError) as info:
        runner.fit(make_data(), epochs=1)
    message = str(info.value)
    assert "rank 1 was at its smallest micro-batch" in message and "this rank at micro-batch 8" in message, message
    assert "checkpointing_fallback=True" in message
    assert len(votes) == 1  # one sync point, then every rank gives up
    assert runner.step == 1 and runner.micro_batch == 8  # the step undone, its micro-batch too


def test_a_peer_at_its_floor_turns_checkpointing_on_every_rank(one_rank_group, monkeypatch):
    runner = _runner(FaultInjector([(1, "forward")]), checkpointing_fallback=True)
    _with_peer(monkeypatch, runner, lambda row: [1, 0, 1, 0, 0])  # at its floor, the fallback still left
    result = runner.fit(make_data(), epochs=1)
    assert [(r["action"], r["micro_batch"]) for r in result.oom_recoveries] == [("checkpointing", 1)]
    assert runner.checkpoint_handle is not None and result.steps == 3


def test_a_rank_out_of_options_tells_its_peers_before_giving_up(one_rank_group, monkeypatch):
    runner = _runner(FaultInjector([(1, "forward")]), micro_batch=2, min_micro_batch=2)
    votes = _with_peer(monkeypatch, runner, lambda row: [4, 0, 0, 0, 0])  # the peer at 8 would have halved
    with pytest.raises(StepOutOfMemoryError) as info:
        runner.fit(make_data(), epochs=1)
    assert "micro-batch 2, the smallest min_micro_batch=2 allows" in str(info.value)
    assert [rows[0] for rows in votes] == [[2, 0, 1, 1, 0]]  # its vote: at its floor, it stops


def test_steps_without_an_oom_hold_no_vote(one_rank_group, monkeypatch):
    runner = _runner(micro_batch=4)
    votes = _with_peer(monkeypatch, runner, lambda row: row)
    assert runner.fit(make_data(), epochs=1).steps == 3
    assert votes == []
