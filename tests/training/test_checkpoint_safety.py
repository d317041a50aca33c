"""Checkpoints are data, never code: hostile, foreign, torn and mismatched files are refused
with one line that names the file, and nothing in them runs."""

from __future__ import annotations

import pathlib

import pytest
import torch

from autobatch import CheckpointError, Runner
from autobatch.training.checkpoints.checkpoint_io import RUNNER_FORMAT, load_checkpoint
from runner_workloads import make_data, make_model, mse


class Payload:
    """Pickles to "call pathlib.Path.touch(marker)": what a malicious checkpoint would run."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def _runner(model=None, **options):
    model = model or make_model()
    return Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=8,
                  progress=False, **options)


def _hostile(tmp_path) -> tuple[pathlib.Path, pathlib.Path]:
    marker = tmp_path / "payload-ran"
    path = tmp_path / "last.pt"
    torch.save({"format": RUNNER_FORMAT, "step": 1, "x": Payload(marker)}, path)
    return path, marker


def test_a_pickled_payload_never_runs(tmp_path):
    path, marker = _hostile(tmp_path)
    with pytest.raises(CheckpointError, match="could run code") as caught:
        _runner().fit(make_data(), steps=1, resume=path)
    assert not marker.exists()
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("kind", ["truncated", "not torch", "not ours"])
def test_broken_or_foreign_files_are_one_clear_error(tmp_path, kind):
    runner = _runner(checkpoint_dir=tmp_path / "run")
    runner.fit(make_data(), steps=1)
    good = (tmp_path / "run" / "last.pt").read_bytes()
    path = tmp_path / "bad.pt"
    if kind == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif kind == "not torch":
        path.write_text("hello")
    else:
        torch.save({"weights": torch.zeros(3)}, path)
    with pytest.raises(CheckpointError, match=r"cannot resume from .*bad\.pt: it ") as caught:
        load_checkpoint(path, expect_format=RUNNER_FORMAT)
    assert "\n" not in str(caught.value)


def test_a_checkpoint_of_another_model_names_the_mismatch(tmp_path):
    _runner(checkpoint_dir=tmp_path).fit(make_data(), steps=1)
    other = make_model(width=32)
    with pytest.raises(CheckpointError, match="another model or optimizer"):
        _runner(other).fit(make_data(), steps=2, resume=tmp_path)


def test_a_checkpoint_of_another_optimizer_is_refused_and_changed_settings_are_said(tmp_path, caplog):
    """An SGD run resumed from an AdamW checkpoint crashed mid-step (KeyError: 'momentum');
    a learning rate set anew for the resumed run was replaced by the checkpoint's silently."""
    _runner(checkpoint_dir=tmp_path).fit(make_data(), steps=1)
    model = make_model()
    adam = Runner(model, torch.optim.AdamW(model.parameters()), mse, global_batch=16, micro_batch=8, progress=False)
    with pytest.raises(CheckpointError, match="written with optimizer SGD and this run's is AdamW"):
        adam.fit(make_data(), steps=2, resume=tmp_path)
    model = make_model()
    faster = Runner(model, torch.optim.SGD(model.parameters(), lr=0.5), mse, global_batch=16, micro_batch=8, progress=False)
    with caplog.at_level("WARNING", logger="autobatch"):
        faster.fit(make_data(), steps=2, resume=tmp_path)
    assert "lr 0.1 (this run: 0.5)" in caplog.text and faster.optimizer.param_groups[0]["lr"] == 0.1


def test_the_rng_state_round_trips_through_a_safe_load(tmp_path):
    """Random states are stored as tensors and lists, so the weights-only load reads them."""
    runner = _runner(checkpoint_dir=tmp_path)
    runner.fit(make_data(), steps=2)
    state = load_checkpoint(tmp_path, expect_format=RUNNER_FORMAT)
    assert isinstance(state["rng"]["torch"], torch.Tensor) and isinstance(state["rng"]["python"], list)


def test_the_cli_refuses_a_hostile_checkpoint_in_one_line(cli_here, tmp_path):
    """Through ``main`` in this process, where ``Payload`` is importable: a load that unpickled
    objects would run it (in a fresh process the class would not even be found)."""
    path, marker = _hostile(tmp_path)
    done = cli_here("train", f"train.resume={path}", f"hydra.run.dir={tmp_path / 'out'}", dirs=False)
    assert done.returncode == 2, done.stderr[-2000:]  # bad input, like a bad override
    assert not marker.exists()
    errors = [line for line in done.stderr.splitlines() if "cannot resume" in line]
    assert len(errors) == 1 and str(path) in errors[0], done.stderr[-2000:]


def test_a_file_torch_save_did_not_write_is_not_a_checkpoint(tmp_path):
    """A JSON or text file given as a checkpoint (train_result.json) is named for what it is, not
    read as a legacy pickle and blamed for objects that could run code."""
    from autobatch import CheckpointError
    from autobatch.training.checkpoints.checkpoint_io import load_checkpoint

    path = tmp_path / "train_result.json"
    path.write_text('{"steps": 3}')
    with pytest.raises(CheckpointError, match="it is not an autobatch checkpoint"):
        load_checkpoint(path)


def _damage(path: pathlib.Path, entry_suffix: str) -> bytes:
    """Overwrite 8 bytes in the middle of the zip entry ending in ``entry_suffix`` (the file's
    size and zip structure kept: what a bad disk or a patched copy does); the damaged bytes."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if i.filename.endswith(entry_suffix)), key=lambda i: i.file_size)
    blob = bytearray(path.read_bytes())
    names, extra = struct.unpack("<HH", blob[info.header_offset + 26:info.header_offset + 30])
    middle = info.header_offset + 30 + names + extra + info.file_size // 2
    blob[middle:middle + 8] = bytes(255 - b for b in blob[middle:middle + 8])
    path.write_bytes(bytes(blob))
    return bytes(blob)


def test_review34_damaged_tensor_bytes_are_refused_naming_the_earlier_checkpoint(tmp_path):
    """Bytes overwritten in a tensor's entry loaded (torch.load checks no CRC), and the run resumed
    from wrong weights (NaN loss next step); now one CheckpointError, before anything is loaded,
    naming the entry and the earlier checkpoint kept beside it; the damaged file is left as it is."""
    run = tmp_path / "run"
    _runner(checkpoint_dir=run).fit(make_data(), steps=1)
    _runner(checkpoint_dir=run).fit(make_data(), steps=2)  # a fresh run: the first one's kept as last.earlier-1.pt
    damaged = _damage(run / "last.pt", "data/0")
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError, match=r"last\.pt: it is damaged: the bytes of its entry '.*data/0'") as caught:
        _runner(model, checkpoint_dir=run).fit(make_data(), steps=3, resume=run)
    message = str(caught.value)
    assert f"resume from {run / 'last.earlier-1.pt'}" in message and "\n" not in message
    assert (run / "last.pt").read_bytes() == damaged
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_review34_damaged_pickle_or_cut_file_says_so(tmp_path):
    """A changed byte in data.pkl was "holds objects that ... could run code", a file cut short
    "OSError: [Errno 22] Invalid argument": neither said the file was damaged."""
    _runner(checkpoint_dir=tmp_path).fit(make_data(), steps=1)
    path = tmp_path / "last.pt"
    good = path.read_bytes()
    _damage(path, "data.pkl")
    with pytest.raises(CheckpointError, match=r"it is damaged: the bytes of its entry '.*data\.pkl'.*start afresh"):
        load_checkpoint(path, expect_format=RUNNER_FORMAT)
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match=r"it is cut short.*no earlier checkpoint is kept"):
        load_checkpoint(path, expect_format=RUNNER_FORMAT)
