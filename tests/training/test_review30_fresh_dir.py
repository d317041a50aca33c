"""A run started afresh into a ``checkpoint_dir`` holding another run's checkpoint keeps it.

``Runner(..., checkpoint_dir=D).fit(data)`` without ``resume=`` overwrote the ``last.pt`` an
earlier run left in ``D`` at its first save (a script run again without ``resume=`` lost the
earlier run's progress; only a warning said so). The file is now moved aside to
``last.earlier-<n>.pt`` (never over one kept before), the warning names it, and
``fit(..., resume=<that path>)`` continues the earlier run. A sharded set's files keep their
rank suffix under one number every rank agrees on.
"""

from __future__ import annotations

import logging

import torch

from autobatch import Runner
from autobatch.training.checkpoints.checkpoint_io import load_checkpoint
from autobatch.training.checkpoints.resume_fresh import keep_earlier_run
from autobatch.training.checkpoints.sharded_files import base_path, check_sharded_resume
from runner_workloads import make_data, make_model, mse


def _runner(model, **options) -> Runner:
    return Runner(model, torch.optim.SGD(model.parameters(), lr=0.05), mse, global_batch=16, micro_batch=8,
                  progress=False, log_every=None, **options)


def test_a_fresh_run_keeps_the_earlier_runs_checkpoint_and_it_resumes(tmp_path, caplog):
    data = make_data()
    _runner(make_model(), checkpoint_dir=tmp_path).fit(data, steps=2)
    first = (tmp_path / "last.pt").read_bytes()
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        _runner(make_model(seed=3), checkpoint_dir=tmp_path).fit(data, steps=1)  # afresh, same folder
    kept = tmp_path / "last.earlier-1.pt"
    assert kept.read_bytes() == first  # the earlier run's bytes, not the new run's
    assert load_checkpoint(tmp_path)["step"] == 1  # the new run's own last.pt
    warned = [r.getMessage() for r in caplog.records if "already holds a checkpoint" in r.getMessage()]
    assert len(warned) == 1 and str(kept) in warned[0] and f"resume={str(kept)!r}" in warned[0]
    resumed = _runner(make_model(seed=4), checkpoint_dir=tmp_path / "resumed")
    result = resumed.fit(data, steps=3, resume=kept)  # the path the warning names
    assert result.resumed_from["step"] == 2 and resumed.step == 3


def test_a_third_fresh_run_never_overwrites_a_kept_checkpoint(tmp_path):
    data = make_data()
    for seed in range(3):
        _runner(make_model(seed=seed), checkpoint_dir=tmp_path).fit(data, steps=seed + 1)
        if seed == 1:
            second = (tmp_path / "last.earlier-1.pt").read_bytes()
    assert (tmp_path / "last.earlier-1.pt").read_bytes() == second  # kept as it was
    assert [load_checkpoint(tmp_path / name)["step"] for name in ("last.earlier-1.pt", "last.earlier-2.pt", "last.pt")] == [1, 2, 3]


class _Ranks:
    """A sharded run's ranks as the runner's ``parallel`` sees them: another rank read a higher number."""

    def __init__(self, other: int) -> None:
        self.other, self.asked = other, []

    def is_rank_zero(self) -> bool:
        return True

    def exchange(self, values: list[int], label: str) -> list[list[int]]:
        self.asked.append(values[0])
        return [list(values), [self.other]]


def test_a_sharded_file_is_kept_under_the_number_every_rank_agrees_on(tmp_path):
    own = tmp_path / "last.rank0-of-1.pt"  # this process's shard file (rank 0 of 1 without a process group)
    torch.save({"format": "x"}, own)
    written = own.read_bytes()
    (tmp_path / "last.earlier-2.rank1-of-2.pt").write_bytes(b"older")  # an earlier set, kept before
    ranks = _Ranks(other=5)
    keep_earlier_run(tmp_path, ranks, sharded=True)
    kept = tmp_path / "last.earlier-5.rank0-of-1.pt"
    assert ranks.asked == [3] and not own.exists() and kept.read_bytes() == written
    assert (tmp_path / "last.earlier-2.rank1-of-2.pt").read_bytes() == b"older"
    # resume=last.earlier-5.pt (the name the warning gives) reads this rank's file of that set
    assert base_path(kept) == tmp_path / "last.earlier-5.pt"
    assert check_sharded_resume(base_path(kept), sharded=True) == kept
