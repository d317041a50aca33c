"""``-m model=glob(m*)``: Hydra's glob over a group's options, a sweep its basic sweeper runs,
was refused before any job ran with "autobatch: error: ConfigLoader is not set" (the check of
each job parsed the sweep without the config loader that lists a group's options)."""

from __future__ import annotations

from autobatch.cli import preflight
from autobatch.cli.user_config import composing
from conftest import SMALL


def test_a_glob_over_a_groups_options_is_checked_job_by_job(capsys):
    with composing("probe"):
        jobs = preflight.job_overrides(["model=glob([m*,c*])", "probe.strategy=binary,halving"], multirun=True)
    assert sorted(job[0] for job in jobs) == ["model=cnn", "model=cnn", "model=mlp", "model=mlp"]
    preflight.check("probe", ["-m", "model=glob(m*)", *SMALL])  # composes every job: no error
    assert "error" not in capsys.readouterr().err
