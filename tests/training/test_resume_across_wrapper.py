"""A checkpoint whose checkpointing fallback fired resumes across the DDP wrapper, both ways.

The fallback names the modules it wraps from the model it was given: under torchrun the DDP
wrapper (``module.1``). Written that way, a resume without the wrapper failed with "has no
attribute 'module'", and a checkpoint from one process resumed under DDP with "DistributedDataParallel
has no attribute '1'". A checkpoint now keeps the names relative to the local model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from autobatch import FaultInjector, Runner
from autobatch.training.checkpoints.resume_checks import local_module_names
from conftest import cli_env
from runner_workloads import make_data, make_model, mse

RUN = """
import sys, torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from autobatch import FaultInjector, Runner
from runner_workloads import make_data, make_model, mse
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = torch.nn.parallel.DistributedDataParallel(make_model())
faults = FaultInjector((1, "forward"), times=3) if {write} else None
runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=4, micro_batch=4, progress=False,
                faults=faults, checkpointing_fallback=True, checkpoint_dir={ckpt!r}, distributed=False)
result = runner.fit(make_data(16, 4), steps=2 if {write} else 4, resume=None if {write} else {ckpt!r})
print("checkpointing", result.checkpointing, sorted(runner.checkpoint_handle.modules))
dist.destroy_process_group()
"""


def _under_ddp(ckpt: Path, write: bool) -> str:
    code = RUN.format(tests=str(Path(__file__).parents[1]), write=write, ckpt=str(ckpt))
    done = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def _plain(ckpt: Path, write: bool):
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=4, micro_batch=4,
                    progress=False, faults=FaultInjector((1, "forward"), times=3) if write else None,
                    checkpointing_fallback=True, checkpoint_dir=ckpt)
    return runner, runner.fit(make_data(16, 4), steps=2 if write else 4, resume=None if write else ckpt)


def test_written_under_ddp_resumed_in_one_process(tmp_path):
    assert _under_ddp(tmp_path, write=True).startswith("checkpointing True")
    saved = torch.load(tmp_path / "last.pt", weights_only=True)["checkpointed_modules"]
    assert saved and not any(name.startswith("module.") for name in saved)
    runner, result = _plain(tmp_path, write=False)
    assert result.steps == 4 and sorted(runner.checkpoint_handle.modules) == sorted(saved)


def test_written_in_one_process_resumed_under_ddp(tmp_path):
    _plain(tmp_path, write=True)
    saved = sorted(torch.load(tmp_path / "last.pt", weights_only=True)["checkpointed_modules"])
    assert _under_ddp(tmp_path, write=False) == f"checkpointing True {saved}"


def test_names_with_the_wrappers_prefix_are_read_as_the_local_models():
    model = make_model()
    blocks = [name for name, _ in model.named_children()][1:2]
    assert local_module_names(blocks, model) == blocks
    assert local_module_names([f"module.{name}" for name in blocks], model) == blocks  # written by an older version
