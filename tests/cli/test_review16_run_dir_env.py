"""``hydra.run.dir=${oc.env:SCRATCH}/runs`` with ``SCRATCH`` unset: Hydra's run crashed with a
traceback (and "An error occurred during Hydra's exception formatting"), exit status 1. The
check before the run resolves the directory as the run will and says it in one line; an
interpolation of ``hydra`` keys, which only Hydra's run resolves, is still left to it."""

from __future__ import annotations

import pytest

from autobatch.cli import preflight
from autobatch.cli.errors import CLIError
from conftest import SMALL


def test_an_unset_variable_in_the_run_directory_is_one_line(monkeypatch):
    monkeypatch.delenv("AUTOBATCH_REVIEW16_UNSET", raising=False)
    with pytest.raises(CLIError) as raised:
        preflight.check("probe", [*SMALL[:3], "hydra.run.dir=${oc.env:AUTOBATCH_REVIEW16_UNSET}/runs"])
    assert raised.value.exit_code == 2
    assert raised.value.message.startswith("hydra.run.dir=${oc.env:AUTOBATCH_REVIEW16_UNSET}/runs: ")
    assert "Environment variable 'AUTOBATCH_REVIEW16_UNSET' not found" in raised.value.message
    preflight.check("probe", [*SMALL[:3], "hydra.run.dir=${hydra:runtime.cwd}/runs"])  # Hydra's own: not judged here
