"""Review 11: what a Hydra user tries next.

* The ``command`` a run records (``result.json``, ``train_result.json``) was not shell-quoted
  (``data.shape=[16]`` is a glob to a shell) and dropped the ``hydra.*`` overrides given
  (``hydra.job.chdir=true``, ``hydra.run.dir=...``), so pasting it did not rerun the job.
* Hydra's ``--run`` / ``-r`` was refused as an unknown option.
* Under ``hydra.job.chdir=true`` a ``data.dataset`` with a relative ``root`` was looked for in the
  run directory by the job, while ``train``'s probe child (which starts where the command ran)
  found it: the probe ran, then the job failed. It is now from where the command ran in both.
* A dict given to a node (``data=dataset 'data.dataset={...root: data}'``, ``probe={stratgy:
  binary}``) was refused as "data has no key 'dataset' (did you mean data.dataset?)"; an
  interpolation that failed did not name the key that holds it.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from torch.utils.data import Dataset

from conftest import SMALL


class RootedSamples(Dataset):
    """(input, target) pairs whose count is read from ``<root>/count.txt`` (a dataset on disk)."""

    def __init__(self, root: str) -> None:
        self.size = int((Path(root) / "count.txt").read_text())

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        import torch

        return torch.full((16,), float(index % 3)), index % 10


def _one_error(done) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("autobatch: error: "), done.stderr
    return lines[0]


def test_the_recorded_command_is_quoted_and_keeps_the_hydra_overrides(cli_here, tmp_path):
    run = tmp_path / "my run"
    args = ["model=mlp", *SMALL[:3], "probe.memory_limit=1MiB", "train.inject_oom=[[3,backward]]"]
    hydra = ["hydra.job.chdir=true", f"hydra.run.dir={run}"]
    done = cli_here("probe", *args, *hydra, dirs=False)
    assert done.returncode == 0, done.stderr
    command = json.loads((run / "result.json").read_text())["command"]
    assert shlex.split(command) == ["python", "-m", "autobatch", "probe", *args, *hydra]  # Hydra's hydra.mode=RUN is not
    assert "'data.shape=[16]'" in command  # no glob for the shell


def test_a_sweep_jobs_command_is_one_run_of_that_job(cli_here, tmp_path):
    done = cli_here("probe", "-m", "model=mlp", *SMALL[:3], "probe.memory_limit=1MiB,2MiB", "hydra.job.chdir=true")
    assert done.returncode == 0, done.stderr
    words = shlex.split(json.loads((tmp_path / "sweep" / "1" / "result.json").read_text())["command"])
    assert "probe.memory_limit=2MiB" in words and "hydra.job.chdir=true" in words
    assert not any(word.startswith("hydra.mode") for word in words)  # Hydra's MULTIRUN: rerun as a sweep of one


def test_hydras_run_flag_is_accepted(cli_here, tmp_path):
    done = cli_here("probe", "--run", "model=mlp", *SMALL[:3], "probe.memory_limit=1MiB", "-r")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "run" / "result.json").is_file()
    assert "-r and -m do not go together" in _one_error(cli_here("probe", "-r", "-m", "model=mlp"))


def test_a_relative_dataset_root_is_from_where_the_command_ran_under_chdir(cli_here, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "count.txt").write_text("40\n")
    dataset = "data.dataset={_target_: test_review11_cli_hydra_use.RootedSamples, root: data}"
    args = ["train", "model=mlp", *SMALL[:3], dataset, "train.micro_batch=8", "train.steps=2", "hydra.job.chdir=true"]
    done = cli_here(*args)
    assert done.returncode == 0, done.stderr  # was: could not open a path (FileNotFoundError: 'data/count.txt')
    assert json.loads((tmp_path / "run" / "train_result.json").read_text())["steps"] == 2
    missing = cli_here(*[a.replace("root: data", "root: nodata") for a in args], f"hydra.run.dir={tmp_path / 'run2'}",
                       dirs=False)
    line = _one_error(missing)
    assert "data.dataset" in line and "nodata" in line and "hydra.job.chdir=true" in line and "runtime.cwd" in line


def test_from_launch_dir_rewrites_only_existing_paths_under_a_paths_name(tmp_path, monkeypatch):
    from autobatch.cli import construct

    (tmp_path / "data").mkdir()
    (tmp_path / "train").mkdir()
    monkeypatch.setattr(construct, "_moved_from", lambda: tmp_path)
    node = {"_target_": "x.Y", "root": "data", "split": "train", "cache_dir": "absent", "data_files": ["data", "nope"],
            "transform": {"_target_": "x.Z", "path": "data"}, "url_path": "https://host/data"}
    assert construct.from_launch_dir(node) == {
        **node, "root": str(tmp_path / "data"), "data_files": [str(tmp_path / "data"), "nope"],
        "transform": {"_target_": "x.Z", "path": str(tmp_path / "data")},
    }  # fmt: skip
    monkeypatch.setattr(construct, "_moved_from", lambda: None)
    assert construct.from_launch_dir(node) is node  # the job runs where the command ran: as given


def test_a_dict_merged_into_a_node_names_the_key_inside_it(cli_here):
    dataset = "data.dataset={_target_: my.Data, root: data}"
    line = _one_error(cli_here("probe", "data=dataset", dataset))
    assert "data.dataset has no key 'root'" in line and "+data.dataset.root=" in line and "drop data=dataset" in line
    assert "did you mean data.dataset" not in line
    line = _one_error(cli_here("probe", "probe={stratgy: binary}"))
    assert "probe has no key 'stratgy' (did you mean probe.strategy?)" in line


def test_a_failed_interpolation_names_its_key(cli_here):
    assert "model.layers: Interpolation key 'nope' not found" in _one_error(cli_here("probe", "model.layers=${nope}"))
    line = _one_error(cli_here("probe", "probe.max_batch=${oc.env:AUTOBATCH_NO_SUCH_VARIABLE}"))
    assert line.startswith("autobatch: error: probe.max_batch: ") and "AUTOBATCH_NO_SUCH_VARIABLE" in line
