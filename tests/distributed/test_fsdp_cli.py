"""``python -m autobatch train train.fsdp=true`` under torchrun: two CPU ranks (gloo) shard a
small GPT. Rank 0's run directory holds everything (each rank's checkpoint shards included),
even when the ranks' Hydra picked different directories; ``final_model.pt`` is the whole,
unsharded state dict (``weights_only=True`` loads it); a resume from the shards continues the
run, which ends where one process training the same global batches ends.

The weights are float32 and the runs reduce gradients in a different order (FSDP's
reduce-scatter of per-rank means), and Adam turns a last-bit difference of a near-zero
gradient into a difference of its step size: after 4 steps the largest is 1.8e-5, the same as
DDP's under torchrun against one process. So they agree to ``rtol=1e-5, atol=1e-4``, not bit
for bit (the bit-exact sharded resume is in ``test_fsdp.py``). Every launch has a timeout.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import cli_in_process
from launcher import torchrun

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

COMMON = [
    "device=cpu", "model=gpt", "model.width=32", "data.seq_len=16", "data.num_samples=64", "train.global_batch=16",
    "train.micro_batch=4", "train.grow_after=0", "train.log_every=0",
]  # fmt: skip
STEPS = 4


def test_fsdp_cli_rank_zero_writes_a_full_final_model_and_resumes_from_the_shards(tmp_path):
    reference = tmp_path / "reference"
    # the one-process run in this process: a subprocess would only add ~4 s of imports
    assert cli_in_process("train", *COMMON, f"train.steps={STEPS}", f"hydra.run.dir={reference}", cwd=tmp_path) == 0

    # each rank's Hydra picks its own directory (as a timestamp can differ between ranks)
    per_rank = "hydra.run.dir=" + str(tmp_path / "run-${oc.env:RANK}")
    first = torchrun("train", *COMMON, "train.fsdp=true", "train.steps=2", "train.checkpoint_every=1", per_rank, cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run = tmp_path / "run-0"
    assert not (tmp_path / "run-1").exists()  # rank 1 wrote into rank 0's directory, and left none of its own
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.rank0-of-2.pt", "last.rank1-of-2.pt"]
    assert "checkpoint      " + str(run / "checkpoints" / "last.rank0-of-2.pt") in first.stdout

    second = torchrun("train", *COMMON, "train.fsdp=true", f"train.steps={STEPS}", f"train.resume={run}",
                      f"hydra.run.dir={run}", cwd=tmp_path)  # fmt: skip
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    summary = json.loads((run / "train_result.json").read_text())
    assert summary["resumed_from"]["step"] == 2 and summary["steps"] == STEPS and summary["ranks"] == 2
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == list(range(1, STEPS + 1))

    # the whole model, plain CPU tensors: the unsharded model's keys and shapes, the same weights
    got = torch.load(run / "final_model.pt", weights_only=True)
    expected = torch.load(reference / "final_model.pt", weights_only=True)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert type(got[name]) is torch.Tensor and got[name].device.type == "cpu", name
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-4, msg=name)
