"""Review 31: Hydra multirun sweeps on the command line, as a new user tries them.

* ``train -m ... train.resume=latest`` continuing a sweep with its values in another order
  (``optimizer.lr=0.001,0.01`` after ``optimizer.lr=0.01,0.001``) resumed job 0 from the
  checkpoint of the earlier sweep's job 0, the other learning rate: the run kept that one (a note),
  the summary row named the new one, and the two jobs' records were crossed from then on.
* ``python -m autobatch probe model=mlp --info``: Hydra's flags are put before the overrides,
  and ``--info`` (its value optional) then took ``model=mlp`` as its value: "invalid choice".
"""

from __future__ import annotations

import json

import pytest
from hydra._internal.utils import get_args_parser
from omegaconf import OmegaConf

from autobatch.cli.preflight import flags_first
from autobatch.cli.resume_job import agreed_resume_target


def _sweep_job(tmp_path, started_lr: float):
    """A sweep directory whose ``multirun.yaml`` sweeps ``optimizer.lr`` and whose job 0 holds a
    checkpoint of a run started with ``started_lr``."""
    sweep = tmp_path / "sweep"
    job = sweep / "0"
    (job / "checkpoints").mkdir(parents=True)
    (job / "checkpoints" / "last.pt").write_bytes(b"x")
    (job / "result.json").write_text(json.dumps({"batch_size": 8, "config": {"optimizer": {"lr": started_lr}}}))
    task = ["model=mlp", "optimizer.lr=0.001,0.01", "train.steps=8", "train.resume=latest"]
    OmegaConf.save(OmegaConf.create({"hydra": {"overrides": {"task": task}}}), sweep / "multirun.yaml")
    return sweep, job


def test_review31_a_sweep_continued_in_another_order_is_refused(tmp_path):
    sweep, job = _sweep_job(tmp_path, started_lr=0.01)
    cfg = OmegaConf.create({"optimizer": {"lr": 0.001}, "train": {"steps": 8, "resume": "latest"}})
    with pytest.raises(ValueError) as refused:
        agreed_resume_target("latest", "checkpoints", tmp_path, job, sweep=True, cfg=cfg, sweep_dir=sweep)
    message = str(refused.value)
    assert message.startswith("the checkpoint in this job's run directory is another job's: optimizer.lr=0.01, "
                              "not optimizer.lr=0.001 ("), message
    assert "give them in the order the sweep first had them, or a new hydra.sweep.dir" in message
    # the same job in the sweep's first order resumes its own checkpoint (train.steps may change)
    same = OmegaConf.create({"optimizer": {"lr": 0.01}, "train": {"steps": 16, "resume": "latest"}})
    path, own = agreed_resume_target("latest", "checkpoints", tmp_path, job, sweep=True, cfg=same, sweep_dir=sweep)
    assert (path, own) == (job / "checkpoints" / "last.pt", True)


@pytest.mark.parametrize("args", [["model=mlp", "--info"], ["--info", "model=mlp"], ["-m", "model=mlp", "-i"]])
def test_review31_info_without_a_value_leaves_the_overrides_alone(args):
    parsed = get_args_parser().parse_args(flags_first(args))
    assert parsed.info == "all" and parsed.overrides == ["model=mlp"]
    assert get_args_parser().parse_args(flags_first(["model=mlp", "--info", "defaults"])).info == "defaults"
