"""Real-GPU check of AutoBatchSize: its size trains Lightning's own ``fit`` under the same cap.
Skipped without CUDA (or Lightning); run with ``bash scripts/gpu_tests.sh``."""

import pytest
import torch
from torch import nn

from autobatch import free_memory
from autobatch.workloads.models import GPT

if not torch.cuda.is_available():  # before importing Lightning: CI without a GPU pays nothing
    pytest.skip("needs a CUDA device", allow_module_level=True)
pl = pytest.importorskip("lightning.pytorch")

from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB, SEQ, CAP = 16384, 256, 3 * 2**30


class LM(pl.LightningModule):
    """GPT-like; ``keep`` holds each step's logits until the next (an epoch-end metric)."""

    def __init__(self, keep: bool) -> None:
        super().__init__()
        self.batch_size, self.keep, self.kept, self.steps = 2, keep, None, 0
        torch.manual_seed(0)
        self.model = GPT(VOCAB, SEQ, layers=4, width=256, heads=4)
        tokens = torch.randint(0, VOCAB, (512, SEQ + 1))
        self.data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])

    def training_step(self, batch, index):
        x, y = batch
        logits = self.model(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        self.log("loss", loss)
        return {"loss": loss, "logits": logits.detach()}

    def on_train_batch_end(self, outputs, batch, index):
        self.steps += 1
        if self.keep:
            self.kept = outputs["logits"]

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size, shuffle=True, drop_last=True)


@pytest.mark.parametrize("keep", [False, True], ids=["plain", "keeps-logits"])
def test_the_size_trains_20_steps_of_fit_under_the_cap(keep):
    """The answer trains 20 steps of fit, also where the module keeps each batch's logits (memory
    the loop holds batch after batch, carried to the epoch's end by the confirmation: an expected
    failure until that; it passed in every GPU run of 2026-11-26 on an H200)."""
    free_memory()
    torch.cuda.set_per_process_memory_fraction(CAP / torch.cuda.get_device_properties(0).total_memory)
    try:
        module, finder = LM(keep), AutoBatchSize()
        trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=20, max_epochs=-1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, callbacks=[finder])
        trainer.fit(module)  # an OOM here fails the test
        print(finder.confirmation.summary())
        # the confirmation's runs call the module's hooks too (as BatchSizeFinder's do): count fit's own steps
        assert trainer.global_step == 20 and module.batch_size == finder.batch_size > 1
        assert any(run.passed and run.batch_size == finder.batch_size for run in finder.confirmation.runs)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        free_memory()


class _LoadedPlace(pl.Callback):
    """Records where the checkpoint ``fit(ckpt_path=...)`` loaded sits at ``on_fit_start``."""

    devices: set[str] = set()

    def on_fit_start(self, trainer, pl_module):
        def walk(value):
            if isinstance(value, torch.Tensor):
                self.devices.add(value.device.type)
            elif isinstance(value, dict):
                for item in value.values():
                    walk(item)
            elif isinstance(value, (list, tuple)):
                for item in value:
                    walk(item)

        walk(trainer._checkpoint_connector._loaded_checkpoint)


def test_a_run_resumed_from_a_checkpoint_without_the_callback_gets_a_fresh_runs_size(tmp_path):
    """A checkpoint saved by a plain ``fit`` (no callback state) is resumed with the callback: its
    size is the fresh run's (within 3 %: trials differ a little), and fit trains to its end at it.
    Lightning holds the loaded checkpoint until it restores the optimizers, after ``on_fit_start``;
    it loads it into host memory (measured on an H200: every tensor on the CPU), which the probe
    must not count (``lightning_state.parked_checkpoint`` keeps it so under simulated memory, and
    moves any tensor a custom ``CheckpointIO`` put on the GPU to the host while probing)."""
    free_memory()
    torch.cuda.set_per_process_memory_fraction(CAP / torch.cuda.get_device_properties(0).total_memory)
    options = dict(accelerator="gpu", devices=1, max_epochs=-1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    try:
        plain = pl.Trainer(max_steps=3, **options)
        plain.fit(LM(False))
        path = tmp_path / "plain.ckpt"
        plain.save_checkpoint(path)
        del plain
        free_memory()
        fresh = AutoBatchSize()
        pl.Trainer(max_steps=1, callbacks=[fresh], **options).fit(LM(False))
        free_memory()
        place, resumed = _LoadedPlace(), AutoBatchSize()
        trainer = pl.Trainer(max_steps=10, callbacks=[place, resumed], **options)
        module = LM(False)
        trainer.fit(module, ckpt_path=path)  # an OOM here fails the test
        print(f"fresh {fresh.batch_size}, resumed {resumed.batch_size}, loaded on {sorted(place.devices)}")
        assert place.devices  # the checkpoint was loaded and held at on_fit_start
        assert trainer.global_step == 10 and module.batch_size == resumed.batch_size
        assert resumed.batch_size >= 0.97 * fresh.batch_size
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        free_memory()


def test_a_run_resumed_on_less_memory_is_searched_down_and_trains_the_checkpoints_samples_per_step(tmp_path):
    """A run probed and checkpointed under ``CAP`` is resumed under half of it (a smaller GPU): the
    checkpoint's size no longer fits, so one trial there fails, the search steps down from it, and
    the resumed fit trains the checkpoint's samples per optimizer step as micro-batches that fit
    (one warning), where it used to run out of memory at its first step (``lightning_trials.kept_fits``)."""
    free_memory()
    total = torch.cuda.get_device_properties(0).total_memory
    options = dict(accelerator="gpu", devices=1, max_epochs=-1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    try:
        torch.cuda.set_per_process_memory_fraction(CAP / total)
        first = AutoBatchSize()
        trainer = pl.Trainer(max_steps=3, callbacks=[first], **options)
        trainer.fit(LM(False))
        path = tmp_path / "run.ckpt"
        trainer.save_checkpoint(path)
        del trainer
        free_memory()
        torch.cuda.set_per_process_memory_fraction(CAP / 2 / total)
        resumed, module = AutoBatchSize(), LM(False)
        trainer = pl.Trainer(max_steps=13, callbacks=[resumed], **options)
        with pytest.warns(UserWarning, match="this machine's memory fits batches up to"):
            trainer.fit(module, ckpt_path=path)  # an OOM here fails the test
        accumulation = trainer.accumulate_grad_batches
        print(f"checkpoint {first.batch_size}, resumed {resumed.batch_size} x {accumulation}")
        assert resumed.batch_size < first.batch_size and module.batch_size == resumed.batch_size
        assert resumed.batch_size * accumulation == first.batch_size
        assert trainer.global_step == 13
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        free_memory()
