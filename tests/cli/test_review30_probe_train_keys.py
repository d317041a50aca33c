"""Review 30: ``python -m autobatch probe train.steps=50`` was accepted without a word, though the probe reads no
``train.steps``: the schema is shared by both commands (so no error), and a ``train.*`` override given to ``probe``
on the command line is now one warning line naming the command it applies to, once for a sweep of it too."""

from __future__ import annotations

from autobatch.cli import preflight
from autobatch.cli.ignored import unread_overrides

CPU = ["device=cpu", "probe.cache=false", "probe.max_batch=2"]


def test_a_train_override_probe_does_not_read_is_named_with_the_command_it_applies_to():
    given = ["train.steps=50", "++train.lr=0.1", "train.global_batch=8", "train.fsdp=true", "train.max_grad_norm=1",
             "train.micro_batch=4", "~train.epochs", "probe.max_batch=2"]
    assert unread_overrides("probe", given) == [
        "probe ignores train.steps=50 (a train setting); it applies to python -m autobatch train",
        "probe ignores train.lr=0.1 (a train setting); it applies to python -m autobatch train"]
    assert unread_overrides("train", given) == []


def test_a_sweep_of_a_train_key_under_probe_is_warned_once(capsys, monkeypatch):
    jobs = []  # the jobs' configs are checked elsewhere (and cost a compose each): here the line's count
    monkeypatch.setattr(preflight, "job_overrides", lambda overrides, multirun: jobs.append(multirun) or [])
    preflight.check("probe", ["-m", *CPU, "train.steps=5,6"])
    assert jobs == [True]
    lines = [line for line in capsys.readouterr().err.splitlines() if "probe ignores" in line]
    assert lines == ["autobatch: warning: probe ignores train.steps=5,6 (a train setting); it applies to "
                     "python -m autobatch train"]
