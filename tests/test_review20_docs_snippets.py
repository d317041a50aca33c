"""The first example a user copies from the planning and runner pages runs as printed.

Each page opens with a Python block that leaves its inputs (``step``, ``model``, ``loader``,
...) to the reader; here they are a tiny model and two global batches, and the block itself is
executed verbatim from the page, so a renamed argument, attribute or method there fails.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from conftest import REPO

import autobatch


def _first_python_block(page: str) -> str:
    text = (REPO / "docs" / page).read_text()
    return re.search(r"^```python\n(.*?)^```", text, re.S | re.M).group(1)


def _inputs(global_batch: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = lambda model, batch: F.cross_entropy(model(batch[0]), batch[1])  # noqa: E731
    batches = [(torch.randn(global_batch, 8), torch.randint(0, 3, (global_batch,))) for _ in range(2)]
    step = autobatch.TrainStep(model, optimizer, loss_fn, make_batch=lambda b: (torch.randn(b, 8), torch.randint(0, 3, (b,))))
    return {"autobatch": autobatch, "torch": torch, "F": F, "model": model, "optimizer": optimizer,
            "loss_fn": loss_fn, "loader": batches, "step": step,
            "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)}


def test_the_planning_pages_example_runs(capsys):
    scope = _inputs(512)
    weights = [p.detach().clone() for p in scope["model"].parameters()]
    exec(compile(_first_python_block("planning.md"), "docs/planning.md", "exec"), scope)
    assert "global batch    512" in capsys.readouterr().out  # plan.summary()
    assert scope["plan"].global_batch == 512 and sum(scope["plan"].micro_batch_sizes) == 512
    assert any(not torch.equal(w, p) for w, p in zip(weights, scope["model"].parameters()))  # it trained


def test_the_runner_pages_example_runs(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the example checkpoints into "ckpt"
    scope = _inputs(512)
    exec(compile(_first_python_block("runner.md"), "docs/runner.md", "exec"), scope)
    result = scope["result"]
    assert (result.steps, result.samples, result.global_batch) == (6, 6 * 512, 512)
    assert '"steps": 6' in capsys.readouterr().out  # result.to_json(indent=2)
    assert (tmp_path / "ckpt" / "last.pt").is_file()
