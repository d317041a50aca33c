"""Real-GPU checks of the command line's memory regime (issue 16): ``probe`` and ``train`` make the
caching allocator's segments expandable, key their cache by it, ``train`` probes in a child
process and runs within the probe's ``probe.memory_limit``. Skipped without CUDA; each command runs in its own process."""

import json

import pytest
import torch

from conftest import cli_env, run_cli

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SMALL_GPT = ["model=gpt", "model.width=64", "model.layers=2", "model.heads=2", "data.seq_len=64", "data.vocab_size=256"]


def _run(tmp_path, name, *args):
    done = run_cli(*args, f"hydra.run.dir={tmp_path / name}", f"probe.cache_dir={tmp_path / 'cache'}",
                   cwd=tmp_path, env=cli_env(), timeout=600)
    assert done.returncode == 0, done.stderr
    return done


def test_probe_then_train_use_expandable_segments_and_train_within_the_cap(tmp_path):
    args = [*SMALL_GPT, "device=cuda", "probe.memory_limit=1GiB"]
    _run(tmp_path, "probe", "probe", *args)
    probed = json.loads((tmp_path / "probe" / "result.json").read_text())
    assert probed["promise"]["expandable_segments"] is True
    # under the cap with expandable segments: two 20 MiB pages of headroom, never more than 1 %
    capacity = probed["promise"]["capacity_bytes"]
    assert probed["promise"]["allocator_headroom_bytes"] == min(int(capacity * 0.01), 40 * 2**20)
    done = _run(tmp_path, "train", "train", *args, "train.steps=20")
    trained = json.loads((tmp_path / "train" / "train_result.json").read_text())
    assert trained["probe"]["cached"] and trained["micro_batch"] == probed["batch_size"]
    assert trained["oom_recoveries"] == [] and "trained within 1.00 GiB" in done.stdout
    assert any("probed in a child process" in note for note in trained["notes"])  # probe.isolate, on CUDA
    assert json.loads((tmp_path / "train" / "probe" / "result.json").read_text())["cached"]
    # the cache keys the setting: fixed segments are another allocator, so the probe runs again
    _run(tmp_path, "fixed", "probe", *args, "device.expandable_segments=false")
    fixed = json.loads((tmp_path / "fixed" / "result.json").read_text())
    assert not fixed["cached"] and fixed["promise"]["expandable_segments"] is False


def test_a_micro_batch_past_the_cap_is_sized_down_from_measured_memory(tmp_path):
    args = [*SMALL_GPT, "device=cuda", "probe.memory_limit=1GiB"]
    _run(tmp_path, "probe", "probe", *args)
    answer = json.loads((tmp_path / "probe" / "result.json").read_text())["batch_size"]
    big = 2 * answer
    _run(tmp_path, "train", "train", *args, f"train.micro_batch={big}", f"train.global_batch={big}", "train.steps=5")
    trained = json.loads((tmp_path / "train" / "train_result.json").read_text())
    assert trained["oom_recoveries"] and trained["oom_recoveries"][0]["action"] == "measured"
    assert trained["samples"] == 5 * big and trained["micro_batch"] >= 0.8 * answer
