"""AutoBatchSize's answer holds in Lightning's real fit loop (CPU, simulated budget).

The module keeps each step's logits for an epoch-end metric (``on_train_batch_end``), so
Lightning's loop holds a whole step's logits more than the training step itself: the probe's
answer is too large for ``fit`` and the confirmation in the real loop must step it down.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from autobatch import simulated_memory  # noqa: E402
from autobatch.memory.simulated import host_memory  # noqa: E402
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402
from autobatch.workloads.models import GPT  # noqa: E402

VOCAB, SEQ, BUDGET = 4096, 8, "12MiB"


class KeepsLogits(pl.LightningModule):
    """GPT-like: token ids in, logits over the vocabulary (the big tensor), cross-entropy."""

    def __init__(self, batch_size: int = 2) -> None:
        super().__init__()
        self.batch_size = batch_size
        torch.manual_seed(0)
        self.model = GPT(VOCAB, SEQ, layers=1, width=32, heads=2)
        generator = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, VOCAB, (256, SEQ + 1), generator=generator)
        self.data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
        self.kept, self.seen = None, []

    def training_step(self, batch, index):
        x, y = batch
        self.seen.append(x.shape[0])
        logits = self.model(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        self.log("loss", loss)
        return {"loss": loss, "logits": logits.detach()}

    def on_train_batch_end(self, outputs, batch, index):
        self.kept = outputs["logits"]  # alive through the next step: the loop holds it, the step does not

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3, foreach=False)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size, shuffle=True, drop_last=True)


class Capture(pl.Callback):
    def on_fit_start(self, trainer, module):
        with host_memory():  # the test's copies take none of the simulated device's memory
            self._take(trainer, module)

    def _take(self, trainer, module):
        self.model = {k: v.clone() for k, v in module.state_dict().items()}
        self.optimizer = repr(trainer.optimizers[0].state_dict())
        self.rng = torch.get_rng_state()
        self.loop = repr(trainer.fit_loop.state_dict())
        self.step, self.seen = trainer.global_step, len(module.seen)
        self.grads = [p.grad for p in module.parameters()]


def trainer(*callbacks, steps=4):
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      callbacks=list(callbacks))


def fits(batch_size: int) -> bool:
    module = KeepsLogits(batch_size)  # made outside the budget, as in the test below
    with simulated_memory(BUDGET):
        try:
            trainer(steps=3).fit(module)
        except torch.OutOfMemoryError:
            return False
    return True


def test_the_answer_trains_in_lightnings_loop_and_steps_down_by_measurement():
    module, before, after = KeepsLogits(), Capture(), Capture()
    finder = AutoBatchSize(strategy="binary", max_batch=64)
    with simulated_memory(BUDGET):
        trainer(before, finder, after, steps=4).fit(module)  # fit itself trains 4 steps at the size
    size, probed, runs = finder.batch_size, finder.result.batch_size, finder.confirmation.runs
    assert module.seen[after.seen:] == [size] * 4 and module.batch_size == size
    assert not runs[0].passed and runs[0].batch_size == probed and size < probed  # the loop needed more
    assert any(r.passed and r.batch_size == size for r in runs) and len(runs) <= 5
    assert runs[0].extra_bytes > 0 and "trained in Lightning's own fit loop" in finder.result.notes[-1]
    # bit-exact: what the next callback saw is what the previous one saw
    assert before.model.keys() == after.model.keys()
    assert all(torch.equal(before.model[k], after.model[k]) for k in before.model)
    assert before.optimizer == after.optimizer and torch.equal(before.rng, after.rng)
    assert before.loop == after.loop and before.step == after.step == 0
    assert all(g is None for g in after.grads)
    # the largest size fit really trains, by bisection with short real fits (above size: all fail but one)
    low, high = size, probed - 1
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    assert size >= 0.95 * low, (size, low)


def test_review34_a_step_down_in_the_loop_keeps_the_margin(monkeypatch):
    """Review 34: the probe took ``margin`` off its answer, but a loop run that failed stepped down
    to the size filling the budget (the line's 80 here), with none of the room asked for."""
    from autobatch.integrations import lightning_loop
    from autobatch.integrations.lightning_loop import LoopRun, MemoryLine, confirm_in_loop

    line, budget, extra = MemoryLine(1000.0, 0.0), 100_000, 20_000  # 1000 bytes a sample; 80 fit beside the extra

    def run(trainer, size, steps, line, memory, limit, reset):  # over the limit at 90, by measured bytes
        return LoopRun(size, size <= 80, steps, line.at(size) + extra, line.at(size), extra, 0.0)

    monkeypatch.setattr(lightning_loop, "_run_loop", run)
    confirmation = confirm_in_loop(None, 90, probed=90, line=line, memory=None, limit=budget,
                                   apply=lambda largest: (largest, 1), reset=lambda: None, steps=1, margin=0.25)
    assert [(r.batch_size, r.passed) for r in confirmation.runs] == [(90, False), (60, True)]
    assert confirmation.batch_size == 60  # 80 less 25 %, as find_max_batch takes its margin off
