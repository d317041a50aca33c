"""Keys the run will not read, named in a warning: ``train`` keys given to ``probe`` that
change what ``train`` would do, and ``probe``/``plan`` keys given with ``train.resume``.

``probe train.micro_batch=8 train.global_batch=64`` printed a plan of 64 x 1 while ``train``
with the same keys trains 8 x 8 without probing ("``probe`` shows what ``train`` will do");
``train train.resume=... probe.strategy=binary`` silently ran no probe at all.
"""

from __future__ import annotations

from autobatch.cli import preflight
from conftest import SMALL


def _warnings(capsys, command, *args):
    capsys.readouterr()
    preflight.check(command, list(args))
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("autobatch: warning:")]


def test_probe_names_the_train_keys_it_does_not_apply(capsys):
    found = _warnings(capsys, "probe", *SMALL, "train.micro_batch=8", "train.global_batch=64", "train.max_micro_batch=16",
                      "train.resume=latest")
    assert len(found) == 3
    assert "train.micro_batch=8 is ignored by probe" in found[0] and "no probe or plan" in found[0]
    assert "train.max_micro_batch=16 is ignored by probe" in found[1]
    assert "train.resume=latest is ignored by probe" in found[2]
    assert _warnings(capsys, "probe", *SMALL, "train.global_batch=64", "train.steps=5") == [  # review 30: named too
        "autobatch: warning: probe ignores train.steps=5 (a train setting); it applies to python -m autobatch train"]


def test_train_names_the_probe_keys_a_resume_does_not_read(capsys):
    found = _warnings(capsys, "train", *SMALL[:3], "train.resume=latest", "probe.strategy=binary", "probe.memory_limit=8MiB")
    assert found == ["autobatch: warning: probe.strategy is ignored: train.resume=latest takes the checkpoint's "
                     "batches with no probe or plan (drop train.resume to probe afresh)"]  # memory_limit: read


def test_train_steps_beside_train_epochs_is_named(capsys):
    found = _warnings(capsys, "train", *SMALL[:3], "train.steps=500", "train.epochs=2")
    assert found == ["autobatch: warning: train.steps=500 is ignored: train.epochs=2 sets the run's length (drop "
                     "train.epochs to train a number of steps)"]
    assert _warnings(capsys, "train", *SMALL[:3], "train.epochs=2") == []


def test_data_keys_the_data_does_not_read_are_named(capsys):
    found = _warnings(capsys, "train", *SMALL[:3], "train.shuffle=false")
    assert found == ["autobatch: warning: train.shuffle is ignored: it shuffles a data.dataset, and synthetic batches "
                     "are generated, not drawn"]
    found = _warnings(capsys, "train", "model=mlp", "data=dataset", "data.num_samples=100", "train.shuffle=false")
    assert found == ["autobatch: warning: data.num_samples is ignored: an epoch is one pass over data.dataset"]
