"""``python -m autobatch train`` run, stopped and continued as an ML engineer does (review 25).

* A run continued in its own directory (``train.resume=latest hydra.run.dir=RUN``) rewrote
  ``train_result.json`` with ``"probe": null`` (no probe runs on resume: the answer the run
  trained on was gone from its record) and ``samples`` of the last command only, beside
  ``steps`` of the whole run. The record now carries the run's probe over and adds
  ``samples_in_all``.
* The ``continue with:`` command of a stopped run repeats its ``train.micro_batch``; the
  resumed run then noted "train.micro_batch is ignored on resume", as if something was wrong.
  Only a value other than the checkpoint's micro-batch is noted now, with both values.
* The summary named the checkpoint and the record but not ``final_model.pt``, the weights a user
  wants after training: a ``final model`` line now names it.
"""

from __future__ import annotations

import json

import torch
from omegaconf import OmegaConf

from autobatch.cli.resume_state import micro_batch_notes
from autobatch.cli.run_record import earlier_probe, samples_in_all


def _metrics(path, steps, samples=16):
    path.write_text("".join(json.dumps({"step": s, "samples": samples, "loss": 1.0}) + "\n" for s in steps))
    return path


def test_samples_in_all_counts_a_whole_run_and_only_a_whole_one(tmp_path):
    assert samples_in_all(_metrics(tmp_path / "a.jsonl", [1, 2, 3, 4])) == 64
    assert samples_in_all(_metrics(tmp_path / "b.jsonl", [4, 5, 6])) is None  # continued in a new directory
    assert samples_in_all(_metrics(tmp_path / "c.jsonl", [])) is None
    assert samples_in_all(tmp_path / "missing.jsonl") is None


def test_earlier_probe_is_read_from_the_run_a_checkpoint_belongs_to(tmp_path):
    run, new = tmp_path / "run", tmp_path / "new"
    (run / "checkpoints").mkdir(parents=True)
    new.mkdir()
    (run / "result.json").write_text(json.dumps({"batch_size": 12, "command": "python -m autobatch train", "config": {}}))
    checkpoint = run / "checkpoints" / "last.pt"
    assert earlier_probe(checkpoint, "checkpoints", run) == {"batch_size": 12}  # in place
    assert earlier_probe(checkpoint, "checkpoints", new) == {"batch_size": 12}  # into a new run directory
    (new / "train_result.json").write_text(json.dumps({"probe": {"batch_size": 9}}))
    assert earlier_probe(checkpoint, "checkpoints", new) == {"batch_size": 9}  # a resumed run's record carries it
    assert earlier_probe(None, "checkpoints", run) is None  # not a resume: nothing carried


def test_the_runs_own_micro_batch_on_resume_is_no_news():
    state = {"result": {"micro_batch": 8}}
    assert micro_batch_notes(OmegaConf.create({"micro_batch": 8}), state) == []
    assert micro_batch_notes(OmegaConf.create({"micro_batch": None}), state) == []
    [note] = micro_batch_notes(OmegaConf.create({"micro_batch": 16}), state)
    assert note == "train.micro_batch=16 is ignored on resume: the checkpoint's micro-batch 8 is used"


def test_a_run_continued_in_place_keeps_its_probe_and_counts_every_sample(cli_here, tmp_path):
    args = ["model=mlp", "model.width=8", "model.layers=1", "data.shape=[4]", "data.num_samples=16",
            "probe.max_batch=8", "probe.plot=false", "train.steps=2"]
    first = cli_here("train", *args)
    assert first.returncode == 0, first.stderr
    probed = json.loads((tmp_path / "run" / "train_result.json").read_text())["probe"]["batch_size"]
    second = cli_here("train", *args[:-1], "train.steps=4", "train.resume=latest")
    assert second.returncode == 0, second.stderr
    record = json.loads((tmp_path / "run" / "train_result.json").read_text())
    assert record["steps"] == 4 and record["samples"] == 2 * probed
    assert record["samples_in_all"] == 4 * probed
    assert record["probe"]["batch_size"] == probed
    final = tmp_path / "run" / "final_model.pt"
    assert f"final model     {final}" in second.stdout  # the summary names the weights, not only the checkpoint
    assert all(isinstance(t, torch.Tensor) for t in torch.load(final, weights_only=True).values())
