"""Sweeps on real launchers: the shipped SLURM launcher config composes and runs its jobs.

The joblib launcher is tested in ``test_cli_sweep.py``. These tests need
``hydra-submitit-launcher`` (``pip install -e ".[slurm]"`` from the checkout) and are skipped without it;
no SLURM is needed: ``hydra/launcher=slurm`` is only composed, and the jobs themselves run
through submitit's local executor (``submitit_local``), which shares the SLURM launcher's
code path in Hydra apart from ``sbatch``.
"""

from __future__ import annotations

import csv
import os

import pytest

from conftest import REPO, SMALL, cli_env

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")


def _env() -> dict[str, str]:
    """The CLI's environment, keeping this interpreter's extra import paths (the plugin's)."""
    return cli_env(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def test_the_slurm_launcher_config_composes_onto_submitit(cli):
    done = cli("probe", "--cfg", "hydra", "hydra/launcher=slurm", "hydra.launcher.partition=gpu", env=_env())
    assert done.returncode == 0, done.stderr
    assert "SlurmLauncher" in done.stdout and "partition: gpu" in done.stdout
    assert "gpus_per_node: 1" in done.stdout and ".submitit/%j" in done.stdout


def test_a_submitit_sweep_runs_every_job_and_summarises(cli, tmp_path):
    done = cli("probe", "-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5",
               "model=mlp,gpt", *SMALL, timeout=300, env=_env())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    with open(tmp_path / "sweep" / "summary.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["status"] for row in rows] == ["ok", "ok"]
