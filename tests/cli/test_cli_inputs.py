"""Inputs the command line used to take silently or report as a failure at run time: each is
now one line naming the key (exit status 2), or one warning when the run goes on.

* a dataset whose constructor cannot open its ``root``, or whose samples are not pairs;
* ``train.micro_batch`` above ``train.global_batch``; a ``probe.memory_limit`` under 1 KiB;
* keys the run will not read (warned about only where the user changed them);
* the probe cache: a relative ``probe.cache_dir`` under ``hydra.job.chdir=true``, unreadable
  entries that ``cache clear`` kept, ``AUTOBATCH_CACHE_DIR`` naming a file;
* ``python -m autobatch plan``.

In-process (``autobatch.__main__.main`` and :func:`autobatch.cli.preflight.check`), tiny models.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from torch.utils.data import Dataset

from autobatch.__main__ import main
from autobatch.cli import preflight

SMALL = ["model=mlp", "data.shape=[16]", "model.width=32", "probe.max_batch=32", "probe.steps_per_trial=1"]


class NeedsRoot(Dataset):
    """A dataset that reads an index file under ``root`` when it is built (as torchvision's do)."""

    def __init__(self, root: str) -> None:
        with open(os.path.join(root, "index.txt"), encoding="utf-8") as handle:
            self.size = len(handle.read().split())

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        return torch.zeros(16), 0


class Triples(Dataset):
    """Samples of three items, not (input, target) pairs."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int):
        return torch.zeros(16), 0, 1.0


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["autobatch"])  # main() sets it for Hydra
    monkeypatch.delenv("AUTOBATCH_TRACEBACK", raising=False)


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("autobatch: error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("dataset, words", [
    ("{_target_: test_cli_inputs.NeedsRoot, root: /missing}", ["data.dataset: test_cli_inputs.NeedsRoot could not "
                                                              "open a path", "FileNotFoundError", "/missing"]),
    ("{_target_: test_cli_inputs.Triples}", ["data.dataset=test_cli_inputs.Triples: its samples must be (input, target) "
                                             "pairs", "data.dataset[0] is a tuple of 3 items (Tensor, int, float)"]),
])  # fmt: skip
def test_a_dataset_that_cannot_be_opened_or_is_not_pairs_is_bad_input(tmp_path, capsys, dataset, words):
    assert main(["probe", *SMALL, f"data.dataset={dataset}", f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    err = _one_error(capsys)
    assert all(word in err for word in words), err


@pytest.mark.parametrize("args, words", [
    (["train.micro_batch=8", "train.global_batch=4"], "train.micro_batch=8 is larger than train.global_batch=4"),
    (["probe.memory_limit=1.5"], "probe.memory_limit='1.5' is 1.5 bytes, not a whole number of bytes"),
    (["device.simulated_budget=512"], "device.simulated_budget=512 is 512 B, too little"),
])  # fmt: skip
def test_sizes_that_cannot_work_are_refused_before_the_run(capsys, args, words):
    assert main(["train", *SMALL, *args]) == 2
    assert words in _one_error(capsys)


def test_plan_is_not_a_command_but_the_error_says_where_it_is(capsys):
    assert main(["plan", "train.global_batch=64"]) == 2
    assert "python -m autobatch probe train.global_batch=N" in _one_error(capsys)


def _warnings(capsys, command: str, *args: str) -> list[str]:
    preflight.check(command, list(args))
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("autobatch: warning:")]


def test_keys_the_run_will_not_read_are_warned_about_once_when_the_user_set_them(capsys):
    found = _warnings(capsys, "train", *SMALL[:3], "train.micro_batch=8", "probe.strategy=binary",
                      "probe.memory_limit=8MiB", "plan.objective=throughput", "plan.balanced=false")
    assert found == ["autobatch: warning: probe.strategy, plan.objective are ignored: train.micro_batch=8 trains that "
                     "micro-batch with no probe or plan (drop train.micro_batch to probe)"]  # memory_limit, balanced: read
    found = _warnings(capsys, "probe", *SMALL, "-m", "plan.timed_steps=2", "probe.strategy=binary,halving")
    assert len(found) == 1 and "plan.timed_steps is ignored: no plan is made without train.global_batch" in found[0]
    assert _warnings(capsys, "probe", *SMALL, "plan.timed_steps=2", "train.global_batch=64") == []
    found = _warnings(capsys, "probe", *SMALL, "probe.isolate=true")
    assert len(found) == 1 and "probe.isolate is for train only" in found[0]
    assert _warnings(capsys, "train", *SMALL, "probe=safe", "train.global_batch=64", "train.micro_batch=8") != []
    assert _warnings(capsys, "train", *SMALL) == [] and _warnings(capsys, "probe", *SMALL, "probe=safe") == []


def test_a_relative_cache_dir_is_the_same_cache_under_hydra_job_chdir(tmp_path, capsys):
    for run in ("a", "b"):
        args = [*SMALL, "probe.cache_dir=mycache", "hydra.job.chdir=true", f"hydra.run.dir={tmp_path / run}"]
        assert main(["probe", *args]) == 0
    assert json.loads((tmp_path / "b" / "result.json").read_text())["cached"] is True
    assert len(list((tmp_path / "mycache").glob("*.json"))) == 1 and not (tmp_path / "a" / "mycache").exists()


def test_cache_clear_removes_unreadable_entries_and_a_cache_dir_that_is_a_file_is_an_error(tmp_path, capsys, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / f"{'ab' * 32}.json").write_text('{"kind": "autobatch.probe-res')  # torn: the probe skips it, every time
    (cache / "notes.json").write_text("{}")  # not named as an entry: not the cache's to delete
    assert main(["cache", "clear", "--dir", str(cache)]) == 0
    assert "removed 1 entry" in capsys.readouterr().out
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == ["notes.json"]
    afile = tmp_path / "afile"
    afile.write_text("x")
    monkeypatch.setenv("AUTOBATCH_CACHE_DIR", str(afile))
    for action in ("list", "clear"):
        assert main(["cache", action]) == 2
        err = _one_error(capsys)
        assert f"{afile} is a file, not a directory" in err and "AUTOBATCH_CACHE_DIR" in err
    assert afile.read_text() == "x"
