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

import pytest
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


def test_review31_final_model_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    """A run continued in its directory writes final_model.pt again; a write that failed part-way
    (a full disk, a kill) left a torn file where the earlier run's final weights were."""
    from autobatch.cli.training import FINAL_MODEL, save_final_model

    earlier = torch.nn.Linear(2, 2)
    save_final_model(earlier, tmp_path)
    real_save = torch.save

    def full_disk(obj, target, *args, **kwargs):
        handle = open(target, "wb") if isinstance(target, (str, bytes, type(tmp_path))) else target
        handle.write(b"PK\x03\x04 torn")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match="No space"):
        save_final_model(torch.nn.Linear(2, 2), tmp_path)
    monkeypatch.setattr(torch, "save", real_save)
    kept = torch.load(tmp_path / FINAL_MODEL, weights_only=True)
    assert torch.equal(kept["weight"], earlier.weight.detach())
    assert [path.name for path in tmp_path.iterdir()] == [FINAL_MODEL]  # no temporary left behind


def test_review31_a_resume_that_cannot_rewrite_metrics_keeps_them(tmp_path, monkeypatch):
    """On resume metrics.jsonl is cut back to the checkpoint's step; it was truncated first and
    then written, so a write that failed (the full disk that stopped the run) lost the earlier
    run's every line."""
    import builtins

    from autobatch.cli import training

    path = tmp_path / "metrics.jsonl"
    lines = "".join(json.dumps({"step": step, "loss": 1.0 / step}) + "\n" for step in range(1, 6))
    path.write_text(lines, encoding="utf-8")

    def full_disk(file, mode="r", *args, **kwargs):
        handle = builtins.open(file, mode, *args, **kwargs)
        if "w" in mode:
            def write(text):
                raise OSError(28, "No space left on device")
            handle.write = write
        return handle

    from autobatch.cli import atomic_write

    for module in (training, atomic_write):  # a write in place, or through the temporary file
        monkeypatch.setattr(module, "open", full_disk, raising=False)
    with pytest.raises(OSError, match="No space"):
        training._metrics_file(path, resumed_step=3)
    assert path.read_text(encoding="utf-8") == lines
    assert [entry.name for entry in tmp_path.iterdir()] == ["metrics.jsonl"]
    monkeypatch.undo()
    with training._metrics_file(path, resumed_step=3) as handle:  # cut back to step 3, then appended to
        handle.write(json.dumps({"step": 4, "loss": 0.0}) + "\n")
    assert [json.loads(line)["step"] for line in path.read_text(encoding="utf-8").splitlines()] == [1, 2, 3, 4]


def test_review31_a_run_record_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    """result.json, plan.json and train_result.json were written in place: a write that failed
    part-way (a full disk, a kill) left a torn record where the earlier run's was (a continued
    sweep's job then skipped the check that its values are the job's own)."""
    import io

    from autobatch.cli.commands import _write_json

    path = tmp_path / "train_result.json"
    _write_json(path, {"steps": 4, "config": {"seed": 0}})
    real_open = io.open

    def full_disk(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        if "w" in mode:
            def write(text):
                handle.buffer.write(text[:5].encode())
                raise OSError(28, "No space left on device")
            handle.write = write
        return handle

    from autobatch.cli import atomic_write

    monkeypatch.setattr(io, "open", full_disk)  # Path.write_text's, in place
    monkeypatch.setattr(atomic_write, "open", full_disk, raising=False)  # the temporary file's
    with pytest.raises(OSError, match="No space"):
        _write_json(path, {"steps": 8, "config": {"seed": 0}})
    monkeypatch.undo()
    assert json.loads(path.read_text(encoding="utf-8"))["steps"] == 4
    assert [entry.name for entry in tmp_path.iterdir()] == [path.name]
