"""Setups :class:`~autobatch.integrations.lightning.AutoBatchSize` cannot serve, refused at fit start
with one clear error each (:func:`checked_setup`): dataloaders passed to ``fit()``, a batch field
Lightning cannot find or set, ``global_batch`` under manual optimization or beside a
``GradientAccumulationScheduler``, or a ``global_batch`` the ranks cannot share. Split from
:mod:`.lightning` (one concept: what is refused before anything runs) to keep that module readable."""

from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.parsing import lightning_hasattr

from .global_batch import check_share
from .lightning_loaders import check_settable

__all__ = ["checked_setup"]


def checked_setup(trainer: Trainer, module: LightningModule, name: str, global_batch: int | None,
                  multiple_of: int) -> int:
    """Raise one clear error for a setup the callback cannot serve; return the world size."""
    if not trainer.fit_loop._data_source.is_module():  # first: else "no field" came, then this, one at a time
        raise ValueError(
            "AutoBatchSize cannot set the batch size of dataloaders passed to fit() directly (they are built "
            "already): build the train dataloader in the module's or datamodule's train_dataloader() from "
            f"{name!r} (a field of either, or of its hparams), as Lightning's BatchSizeFinder requires"
        )
    if not lightning_hasattr(module, name):
        raise AttributeError(
            f"AutoBatchSize: no field {name!r} in the module, its hparams, the datamodule or its hparams; add it "
            "(and build the train dataloader from it) or pass batch_arg_name"
        )
    check_settable(module, name)  # a read-only property failed after the probe's trials
    world = max(1, trainer.world_size)
    if global_batch is None:
        return world
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    if not module.automatic_optimization:  # Lightning accumulates only for automatic optimization
        raise ValueError(
            f"global_batch={global_batch} needs gradient accumulation, which Lightning does not do under "
            "manual optimization (automatic_optimization=False: your training_step steps the optimizers); "
            "drop global_batch, or accumulate in your training_step"
        )
    if any(isinstance(callback, GradientAccumulationScheduler) for callback in trainer.callbacks):
        raise ValueError(
            f"global_batch={global_batch} sets accumulate_grad_batches, and the GradientAccumulationScheduler "
            "callback changes it by epoch: the global batch would not hold; drop global_batch or the scheduler"
        )
    check_share(global_batch, world, multiple_of, unit="rank")
    return world

