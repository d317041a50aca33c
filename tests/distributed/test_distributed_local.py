"""The distributed helpers in one process: no process group, nothing communicated.

The multi-process behaviour is in ``test_distributed.py``; here, the helpers answer for a
single rank, the probe's agreement hook reshapes a trial record, and the errors read well;
and leaving a one-rank group (in a subprocess) frees it before the interpreter's teardown.
"""

from __future__ import annotations

import pytest
import torch

from autobatch import PeerOutOfMemoryError, RankDisagreementError, distributed, is_oom_error
from autobatch.dist.probe import local_step, unwrap
from autobatch.probe.trial import TrialRecord, TrialRunner
from autobatch.probe.train_step import TrainStep


def test_without_a_process_group_every_helper_answers_for_one_rank(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert not distributed.is_distributed()
    assert (distributed.rank(), distributed.world_size(), distributed.is_rank_zero()) == (0, 1, True)
    assert distributed.exchange([3, 4], "x") == [[3, 4]]
    assert distributed.agree(True) and not distributed.agree(False) and distributed.agree(True, op="any")
    assert distributed.agree_min(7) == 7 == distributed.agree_max(7)
    assert distributed.init_from_env("cpu") is False  # WORLD_SIZE unset
    with pytest.raises(ValueError, match="op must be"):
        distributed.agree(True, op="most")


def test_is_rank_zero_reads_the_launcher_environment_before_the_group_exists(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert not distributed.is_rank_zero()


def test_the_timeout_is_configurable_and_checked(monkeypatch):
    monkeypatch.setenv("AUTOBATCH_SYNC_TIMEOUT", "12")
    assert distributed.timeout() == 12
    distributed.set_timeout(2.5)
    try:
        assert distributed.timeout() == 2.5
    finally:
        distributed.set_timeout(None)
    with pytest.raises(ValueError):
        distributed.set_timeout(0)


def test_a_trial_runner_hands_each_record_to_its_agreement_hook():
    seen = []

    def agree(record: TrialRecord) -> TrialRecord:  # another rank ran out of memory
        seen.append(record.batch_size)
        record.passed, record.error = False, "out of memory on rank 1"
        return record

    runner = TrialRunner(lambda size: None, _NullMemory(), 1, agree=agree)
    assert runner(8) is False and runner(8) is False  # recalled, not re-agreed
    assert seen == [8] and runner.records[0].error == "out of memory on rank 1"


def test_agreed_trials_say_alike_whether_a_size_kept_flushing(monkeypatch):
    """Below a size that kept flushing the search runs only full trials, and a passing size whose
    trial flushed may close it: every rank reads both from the agreed record, so one rank's
    flushing steers every rank's next trial the same way (else the ranks call different sizes)."""
    import autobatch.dist.probe as dist_probe

    def exchange(values, label):  # rank 1 failed its settle trial still flushing; rank 0 passed
        other = list(values)
        other[0], other[7], other[8] = 0, 5, 1
        return [list(values), other]

    monkeypatch.setattr(dist_probe.dist_sync, "exchange", exchange)
    mine = TrialRecord(180, True, 100, 0.1, "wall", steps=6, step_peak_bytes=90, resident_bytes=10, flushes=2)
    agreed = dist_probe.agree_trial(mine)
    assert not agreed.passed and agreed.flushed_out and agreed.flushes == 5
    assert agreed.error == "out of memory on rank 1"


def test_a_ddp_like_wrapper_is_probed_on_its_local_module():
    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def no_sync(self):  # pragma: no cover - only its presence matters
            raise AssertionError

    inner = torch.nn.Linear(2, 2)
    wrapped = Wrapper(inner)
    assert unwrap(wrapped) is inner and unwrap(inner) is inner
    step = TrainStep(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1), lambda m, b: m(b).sum(), torch.randn)
    assert local_step(step).model is inner and local_step(step).optimizer is step.optimizer


def test_the_errors_say_what_each_rank_was_doing():
    error = RankDisagreementError(0, "#3 probe result", {0: "#3 probe result", 1: "never reached a sync point"}, reason="late")
    assert "rank 1: never reached a sync point" in str(error) and "AUTOBATCH_SYNC_TIMEOUT" in str(error)
    assert not is_oom_error(error)
    peer = PeerOutOfMemoryError("rank 1 ran out of memory in forward", "forward", [1])
    assert is_oom_error(peer) and peer.phase == "forward"


class _NullMemory:
    def release_cached(self): ...
    def reset_peak(self): ...
    def synchronize(self): ...
    def peak(self): return 0
    def peak_reserved(self): return 0
    def allocated(self): return 0


LEAVE = """
import gc, weakref
import torch.distributed as dist
from autobatch.dist.joining import _leave_at_exit

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
class Holder:  # garbage in a reference cycle that holds the group, as a finished DDP model does
    pass
holder = Holder()
holder.group, holder.me = dist.group.WORLD, holder
gone = weakref.ref(holder)
gc.disable()  # only _leave_at_exit may collect it
del holder
_leave_at_exit()
print("destroyed", not dist.is_initialized(), "freed", gone() is None)
"""


def test_leaving_destroys_the_group_and_frees_the_garbage_that_holds_it():
    """Freed during the interpreter's teardown, a gloo group aborts a finished run (SIGABRT):
    ``_leave_at_exit`` frees it while the interpreter is whole (scripts/diag_gloo_exit.py)."""
    import subprocess
    import sys

    from conftest import cli_env

    done = subprocess.run([sys.executable, "-c", LEAVE], env=cli_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["destroyed", "True", "freed", "True"]


def test_an_oom_inside_ddps_bucket_rebuild_is_fatal_not_an_oom_to_replay():
    """The rank is inside a collective its peers hold: the error must not read as an OOM, which
    the runner would replay (the allocator's message stays in the chained error)."""
    import types

    from autobatch.dist.ddp_step import run_prologue

    def rebuild():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    model = types.SimpleNamespace(require_forward_param_sync=True, reducer=types.SimpleNamespace(_rebuild_buckets=rebuild))
    with pytest.raises(RuntimeError, match="cannot be replayed") as caught:
        run_prologue(model, "step 3")
    assert not is_oom_error(caught.value)
    assert is_oom_error(caught.value.__cause__)
