"""Two ranks on the CPU (gloo): the probe agrees on the smallest budget, the runner recovers
together from an OOM on one rank only, and disagreement ends in an error, never a hang.

Each test starts two processes of ``distributed_worker.py`` and gives them a hard timeout:
a hang kills both and fails the test. Weights are float64; a run that replayed a step with
a halved micro-batch differs from the uninjected run only by summation order (tolerance
``rtol=1e-10, atol=1e-12``, as in the other runner tests); the two ranks agree exactly.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autobatch import Runner, TrainStep, find_max_batch

from conftest import SMALL, cli_env
from launcher import free_port, launch, shared_launch, torchrun
from runner_workloads import assert_weights_close, hungry_mse, make_data, make_model, mse, weights

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

WORKER = Path(__file__).resolve().parents[1] / "distributed_worker.py"


def shared(tmp_path_factory, key: str, *scenarios: str, **env: str) -> tuple[dict[str, list[dict]], Path]:
    """Scenarios that share one launch of the worker (and its ~15 s of start-up); see launcher.py."""
    return shared_launch(tmp_path_factory, key, WORKER, list(scenarios), **env)


#: the scenarios that run in one launch, with a 60 s deadline: these, then those through DDP's reducer
PLAIN = ("probe", "faults", "peer_error", "mismatched", "ddp_squeeze", "ddp_resume", "ddp_faults", "ddp_probe",
         "ddp_sampler")  # ddp_sampler: test_review22_ddp_sampler.py's


def test_probe_takes_the_smallest_budget_over_the_ranks(tmp_path_factory):
    limits = ["3MiB", "1536KiB"]  # the worker's default PROBE_LIMITS
    reports = shared(tmp_path_factory, "plain", *PLAIN, SYNC_TIMEOUT="60")[0]["probe"]
    for strategy in ("binary", "auto"):
        alone = []
        for limit in limits:  # the same probe in this (non-distributed) process, one budget each
            model = make_model(width=16)
            generator = torch.Generator().manual_seed(0)
            step = TrainStep(
                model, torch.optim.SGD(model.parameters(), lr=0.01), hungry_mse,
                lambda size: (torch.randn(size, 6, generator=generator, dtype=torch.float64), torch.zeros(size, 1, dtype=torch.float64)),
            )
            alone.append(find_max_batch(step, strategy=strategy, memory_limit=limit, steps_per_trial=1, max_batch=256, cache=False).batch_size)
        assert alone[0] > alone[1], "the budgets must give different answers for the test to mean anything"
        got = [report[strategy] for report in reports]
        assert got[0]["batch_size"] == got[1]["batch_size"] == min(alone), (strategy, got, alone)
        assert got[0]["trials"] == got[1]["trials"]  # lockstep: the same sizes in the same order


def test_an_oom_on_one_rank_in_any_phase_is_recovered_by_both(tmp_path_factory):
    """Sync points run on a gloo side group (under gloo too), gradients on the default group."""
    runs, directory = shared(tmp_path_factory, "plain", *PLAIN, SYNC_TIMEOUT="60")
    reports, tmp_path = runs["faults"], directory / "faults"
    baseline = [torch.load(tmp_path / reports[rank]["none"]["weights"]) for rank in range(2)]
    for a, b in zip(*baseline, strict=True):
        assert torch.equal(a, b)
    # the uninjected two-rank run equals one process training on the whole global batch
    model = make_model(width=16)
    Runner(model, torch.optim.AdamW(model.parameters(), lr=0.05), mse, global_batch=16, micro_batch=8,
           grow_after=None, progress=False, log_every=None).fit(make_data(48, 16))
    assert_weights_close(baseline[0], weights(model))
    for phase in ("transfer", "forward", "backward", "optimizer"):
        runs = [report[phase] for report in reports]
        after = 4 if phase == "optimizer" else 2  # the micro-batch does not size the optimizer step: the same again
        for rank, run in enumerate(runs):
            assert [(r["step"], r["phase"], r["micro_batch_before"], r["micro_batch"]) for r in run["recoveries"]] == [(1, phase, 4, after)], (phase, rank, run)
            assert run["samples"] == 48 and run["micro_batch"] == after
        assert "rank 1 ran out of memory" in runs[0]["recoveries"][0]["error"]
        assert "injected" in runs[1]["recoveries"][0]["error"]
        got = [torch.load(tmp_path / run["weights"]) for run in runs]
        for a, b in zip(*got, strict=True):
            assert torch.equal(a, b), phase  # the ranks hold identical weights
        assert_weights_close(got[0], baseline[0])
        assert runs[0]["loss"] == runs[1]["loss"]


def test_ddp_recovers_an_oom_inside_the_last_backward_and_the_optimizer_step(tmp_path_factory):
    """Through DDP's own reducer (one bucket per parameter): rank 1 runs out of memory inside
    the last micro-batch's backward while its later buckets are already all-reduced, or inside
    its optimizer step; both ranks replay and end with the uninjected run's weights."""
    runs, directory = shared(tmp_path_factory, "plain", *PLAIN, SYNC_TIMEOUT="60")
    reports, tmp_path = runs["ddp_faults"], directory / "ddp_faults"
    baseline = [torch.load(tmp_path / reports[rank]["none"]["weights"]) for rank in range(2)]
    for a, b in zip(*baseline, strict=True):
        assert torch.equal(a, b)
    model = make_model(width=16)
    Runner(model, torch.optim.AdamW(model.parameters(), lr=0.05), mse, global_batch=16, micro_batch=8,
           grow_after=None, progress=False, log_every=None).fit(make_data(48, 16))
    assert_weights_close(baseline[0], weights(model))
    launched = reports[1]["last_backward"]["launched_at_failure"]
    buckets = reports[1]["last_backward"]["buckets"]
    assert launched and len(launched) < buckets, (launched, buckets)  # it struck with buckets in flight
    assert launched == list(range(len(launched)))  # a prefix of the bucket order
    for phase, where in (("last_backward", "backward"), ("optimizer", "optimizer")):
        runs = [report[phase] for report in reports]
        for rank, run in enumerate(runs):
            assert [(r["step"], r["phase"], r["micro_batch"]) for r in run["recoveries"]] == [(1, where, 4 if where == "optimizer" else 2)], (phase, rank, run)
            assert run["samples"] == 48
        assert "rank 1 ran out of memory" in runs[0]["recoveries"][0]["error"]
        got = [torch.load(tmp_path / run["weights"]) for run in runs]
        for a, b in zip(*got, strict=True):
            assert torch.equal(a, b), phase
        assert_weights_close(got[0], baseline[0])
        assert runs[0]["loss"] == runs[1]["loss"]


def test_the_probe_measures_the_ddp_step_in_lockstep(tmp_path_factory):
    """find_max_batch on a DDP TrainStep runs the real DDP step (trials fail on every rank
    together when one rank's budget is exceeded) and agrees with the local-module probe here
    (the buckets of so small a model are a few KiB); with parameters as large as the
    activations its answer trains through DDP under the same budget."""
    reports = shared(tmp_path_factory, "plain", *PLAIN, SYNC_TIMEOUT="60")[0]["ddp_probe"]
    assert reports[0]["ddp"] == reports[1]["ddp"]
    assert reports[0]["ddp"]["batch_size"] <= reports[0]["local"]["batch_size"]
    assert reports[0]["ddp"]["batch_size"] > 1
    # the probe runs DDP itself under the simulated device too: its answer trains through DDP
    assert all(report["trained"]["recoveries"] == [] for report in reports), [r["trained"] for r in reports]


def test_ddp_a_rank_that_stops_coming_is_a_clear_error_not_a_hang(tmp_path):
    """Rank 1 leaves after two steps; rank 0 waits inside DDP's bucket all-reduce (gloo blocks
    in backward) and ends in RankDisagreementError within the deadline."""
    reports = launch(WORKER, "ddp_stalled", tmp_path, SYNC_TIMEOUT="3")
    assert reports[0]["error"] == "RankDisagreementError", reports[0]
    assert "runner step 2" in reports[0]["message"]
    assert re.search(r"rank 1: #\d+ runner step 1: optimizer stepped", reports[0]["message"]), reports[0]["message"]


def test_a_non_oom_error_on_one_rank_stops_every_rank(tmp_path_factory):
    reports = shared(tmp_path_factory, "plain", *PLAIN, SYNC_TIMEOUT="60")[0]["peer_error"]
    assert reports[1]["error"] == "ValueError"
    assert reports[0]["error"] == "PeerFailedError" and "rank 1 raised an error" in reports[0]["message"]


def test_a_rank_that_skips_a_sync_point_is_a_clear_error_not_a_hang(tmp_path):
    reports = launch(WORKER, "skipped_sync", tmp_path, SYNC_TIMEOUT="3")
    message = reports[0]["message"]
    assert reports[0]["error"] == "RankDisagreementError"
    assert "the sync rank 1 skips" in message and "within 3 s" in message
    assert "rank 1: never reached a sync point" in message


def test_ranks_at_different_sync_points_fail_at_once(tmp_path_factory):
    reports = shared(tmp_path_factory, "plain", *PLAIN, SYNC_TIMEOUT="60")[0]["mismatched"]
    for report in reports:
        assert report["error"] == "RankDisagreementError" and "different sync points" in report["message"]


def test_cli_probe_under_torchrun_agrees_and_rank_zero_writes(tmp_path):
    """``python -m torch.distributed.run --nproc-per-node 2 -m autobatch probe device=cpu``."""
    run_dir = tmp_path / "run"
    done = torchrun("probe", "device=cpu", "model=mlp", "probe.strategy=binary", "probe.memory_limit=8MiB", *SMALL,
                    f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert any("agreed over 2 ranks" in note for note in result["notes"])
    assert done.stdout.count("result.json") == 1  # only rank 0 reports


def test_a_squeeze_on_one_rank_costs_both_a_measured_step_down_not_half(tmp_path_factory):
    """Rank 1 loses 5 % of its budget mid-run under DDP: both ranks replay the step at the one
    micro-batch rank 1's measurement allows (at least 0.8 of the old, not half), no sample lost."""
    reports = shared(tmp_path_factory, "plain", *PLAIN, SYNC_TIMEOUT="60")[0]["ddp_squeeze"]
    assert reports[0]["recoveries"] == [dict(reports[1]["recoveries"][0], error=reports[0]["recoveries"][0]["error"])]
    recovery = reports[0]["recoveries"][0]
    assert recovery["action"] == "measured" and recovery["micro_batch"] >= 0.8 * reports[0]["answer"], recovery
    for report in reports:
        assert report["steps"] == 5 and report["samples"] == report["answer"] * 2 * 5
        assert report["micro_batch"] == recovery["micro_batch"]


#: a rank that joins through ``init_from_env``, sums a tensor with the other, writes the sum
#: to ``<directory>/rank<r>-<pid>`` and exits
JOIN_AND_EXIT = """
import os, sys, torch, torch.distributed as dist
from autobatch.dist.joining import init_from_env
assert init_from_env("cpu")
total = torch.ones(1)
dist.all_reduce(total)
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}-{os.getpid()}"), "w") as out:
    out.write(str(total.item()))
"""


def test_a_group_joined_from_the_environment_is_torn_down_at_exit_so_every_rank_exits_cleanly(tmp_path):
    """Left to the interpreter's teardown, gloo aborted a rank (SIGABRT) in 8 of 16 such runs, and
    torchrun reported the run failed. The ranks are started here as torchrun starts them (its
    environment variables), without torchrun's own process, whose start costs as much as a rank's."""
    script = tmp_path / "join_and_exit.py"
    script.write_text(JOIN_AND_EXIT)
    runs = []
    for _ in range(3):  # three pairs at once: an abort in one run of two slips through all three 1 time in 8;
        # test_distributed_local's test of _leave_at_exit checks the mechanism itself, deterministically
        group = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        runs += [subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  env=cli_env(**group, RANK=str(rank), LOCAL_RANK=str(rank)))
                 for rank in (0, 1)]
    for run in runs:
        out = run.communicate(timeout=180)[0]
        assert run.returncode == 0, out[-2000:]
    sums = [path.read_text() for path in tmp_path.glob("rank*-*")]
    assert sorted(sums) == ["2.0"] * 6  # three runs of two ranks, each summed with its peer


def test_a_ddp_resume_restores_each_ranks_own_random_state(tmp_path_factory):
    """Dropout masks drawn per rank: a run resumed from rank 0's checkpoint ends with the
    uninterrupted run's weights on every rank (each rank's random state was restored, not rank 0's)."""
    reports = shared(tmp_path_factory, "plain", *PLAIN, SYNC_TIMEOUT="60")[0]["ddp_resume"]
    assert all(report["same"] and report["moved"] for report in reports), reports
