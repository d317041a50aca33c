"""Review 10: sweeps started the ways Hydra users start them.

* ``hydra.mode=MULTIRUN`` (on the command line, or in a config of the user's own) is Hydra's
  other way to ask for a sweep; the check before Hydra ran composed its comma lists as one
  run and refused the command with Hydra's "Ambiguous value ... add --multirun".
* ``-m`` (or ``--cfg job``) between overrides (``model=mlp,gpt -m probe.max_batch=64``):
  Hydra's argument parser takes the overrides as one run of positionals, so the ones after the
  flag were "unrecognized arguments", printed as its whole usage text over several lines.
"""

from __future__ import annotations

import csv

import pytest

from conftest import SMALL


def _rows(sweep):
    with open(sweep / "summary.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def test_hydra_mode_multirun_on_the_command_line_sweeps(cli_here, tmp_path):
    done = cli_here("probe", "hydra.mode=MULTIRUN", "model=mlp,gpt", *SMALL)
    assert done.returncode == 0, done.stderr
    assert [(r["job"], r["status"]) for r in _rows(tmp_path / "sweep")] == [("0", "ok"), ("1", "ok")]


def test_hydra_mode_multirun_in_a_users_config_sweeps(cli_here, tmp_path):
    conf = tmp_path / "myconf"
    conf.mkdir()
    (conf / "mysweep.yaml").write_text("defaults:\n  - probe\n  - _self_\nhydra:\n  mode: MULTIRUN\n")
    done = cli_here("probe", "--config-dir", str(conf), "--config-name", "mysweep", "model=mlp,gpt", *SMALL)
    assert done.returncode == 0, done.stderr
    assert len(_rows(tmp_path / "sweep")) == 2


def test_a_bad_override_under_hydra_mode_multirun_is_still_one_line(cli_here):
    done = cli_here("probe", "hydra.mode=MULTIRUN", "model=mlp,gpt", "probe.stratgy=binary", *SMALL)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "autobatch: error: Could not override 'probe.stratgy': probe has no key 'stratgy' (did you mean probe.strategy?)"
    ]


def test_multirun_flag_between_overrides_runs_the_sweep(cli_here, tmp_path):
    done = cli_here("probe", "model=mlp,gpt", "-m", *SMALL)  # the fixture adds the run and sweep dirs after it
    assert done.returncode == 0, done.stderr
    assert "unrecognized arguments" not in done.stderr
    assert len(_rows(tmp_path / "sweep")) == 2


def test_cfg_flag_between_overrides_prints_the_config(cli_here):
    done = cli_here("probe", "model=mlp", "--cfg", "job", "probe.max_batch=64")
    assert done.returncode == 0, done.stderr
    assert "max_batch: 64" in done.stdout and "MLP" in done.stdout


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--cfg", "job", "-m"], "--cfg"),
        (["--info", "-m"], "--info"),
        (["--cfg", "job", "--info"], "--info"),
        (["--resolve"], "--resolve"),
        (["--cfg"], "--cfg"),  # at the end: no value
        (["--cfg", "jobs"], "--cfg"),
        (["--cfg", "job", "--package"], "--package"),
    ],
)
def test_hydra_flags_that_do_not_go_together_are_one_line(cli_here, flags, named):
    """Hydra raised a ValueError outside its error reporting: a traceback, exit status 1."""
    try:
        done = cli_here("probe", *flags, "model=mlp")
    except ValueError as exc:  # what escaped main()
        pytest.fail(f"a traceback: {exc}")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autobatch: error: ") and named in lines[0], done.stderr
