"""A sweep job's overrides as the user gave them (review 26): Hydra's basic sweeper re-renders
each job's overrides with the grammar's characters backslash-escaped, so an interpolation read
``train.lr=$\\{oc.env\\:LR\\}`` in the summary (its row, its "overrides of every job" line) and
in the job's recorded command (``given_overrides``), where one run records it as given."""

from __future__ import annotations

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from autobatch.cli.override_text import as_given
from autobatch.cli.sweep import _job_row
from autobatch.cli.user_config import given_overrides

GIVEN = ["model=mlp", "train.lr=${oc.env:REVIEW26_LR}", "model.width=${.layers}", "train.steps=1,2"]


def _jobs() -> list[list[str]]:
    """Each job's overrides as Hydra's basic sweeper hands them to the job."""
    return BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(GIVEN), None)[0]


def test_sweep_row_and_recorded_overrides_are_as_given():
    first = _jobs()[0]
    assert "train.lr=$\\{oc.env\\:REVIEW26_LR\\}" in first  # what Hydra hands the job
    expected = ["model=mlp", "train.lr=${oc.env:REVIEW26_LR}", "model.width=${.layers}", "train.steps=1"]
    hydra = OmegaConf.create({"job": {"num": 0, "name": "train"}, "overrides": {"task": first, "hydra": []}})
    assert given_overrides(hydra=hydra) == expected  # the job's recorded command and train's probe child
    config = OmegaConf.create({"hydra": OmegaConf.to_container(hydra)})
    returned = JobReturn(overrides=first, status=JobStatus.COMPLETED, _return_value={"batch_size": 2})
    assert _job_row(config, returned)["overrides"] == " ".join(expected)  # summary.csv and the table


def test_escapes_that_change_the_value_are_kept():
    # a comma escaped by the user is part of one string: without the backslash it is a list
    assert as_given(["hydra.run.dir=runs/a\\,b", "x=a\\ b", "y=$\\{.layers\\}"]) == \
        ["hydra.run.dir=runs/a\\,b", "x=a b", "y=${.layers}"]
