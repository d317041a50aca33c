"""Whether the train dataloader ``fit`` built follows the batch size ``AutoBatchSize`` set.

The callback sets the batch attribute (``model.batch_size``, ``hparams``, the datamodule's) and
drops the fit loop's loader, so that ``fit`` calls ``train_dataloader()`` again at the new size.
A datamodule that builds its ``DataLoader`` in ``setup()`` (``self.loader = DataLoader(...,
batch_size=self.batch_size)``) and returns it from ``train_dataloader()`` hands back the loader
built at the old size: ``fit`` trained at the module's own 2 while the callback logged 374 and
its confirmation "confirmed" 374 on batches of 2, with nothing said. Lightning's
``BatchSizeFinder`` has the same blind spot (its trials never grow, so it doubles to its
``max_trials`` and returns a size no trial ran). :func:`check_loader_follows` makes that one
error before the first training step, naming what to change.

:func:`undo_reloaded_draw`: a ``configure_optimizers`` that reads ``trainer.estimated_stepping_batches``
(a ``OneCycleLR``'s total) makes Lightning build the train loader and its iterator before
``on_fit_start``, and the iterator draws its base seed from the global RNG. The callback drops that
loader (re-created at the size set), so ``fit`` drew that seed a second time and the sampler's shuffle
seed came one draw later: the same seed and size trained other batches, in another order, than
``fit`` without the callback (a first batch summing to -50.1 where it summed to 2.7).

:func:`check_settable` refuses, at fit start, a batch attribute the size cannot be written to
(a read-only ``@property def batch_size(self): return self.hparams.batch_size``): the probe ran
its trials and then failed with Python's bare "property 'batch_size' of 'M' object has no
setter" (Lightning's ``BatchSizeFinder`` fails the same way, after its trials too).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.parsing import _lightning_get_all_attr_holders

__all__ = ["check_loader_follows", "check_settable", "loader_batch_size", "undo_reloaded_draw"]


def loader_batch_size(loader: Any) -> int | None:
    """The batch size a ``DataLoader`` batches at (its own, or its batch sampler's); None where
    it has none (an iterable dataset that batches itself, a custom batch sampler)."""
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def check_settable(module: LightningModule, name: str) -> None:
    """An ``AttributeError`` naming the fix where one of the places ``lightning_setattr`` writes
    ``name`` to (the module, its ``hparams``, the datamodule, its ``hparams``) is an object whose
    class makes ``name`` a property without a setter; before the probe, not after its trials."""
    for holder in _lightning_get_all_attr_holders(module, name):
        if isinstance(holder, dict):
            continue
        found = inspect.getattr_static(type(holder), name, None)
        if isinstance(found, property) and found.fset is None:
            raise AttributeError(
                f"AutoBatchSize sets {name} where Lightning's BatchSizeFinder does (lightning_setattr), and "
                f"{type(holder).__name__}.{name} is a property without a setter: add one (@{name}.setter, writing "
                f"where the property reads), or make {name} a plain attribute"
            )


def check_loader_follows(trainer: Trainer, own: Any, size: int | None, name: str, *,
                         before: tuple[int | None, ...] | None = None) -> None:
    """At ``on_train_start`` (``fit`` has built its train dataloader): a ``ValueError`` where the
    callback changed the batch attribute from ``own`` to ``size`` and no train dataloader's batch
    size changed: each batches as it did before the size was set (``before``, the sizes of the
    loaders the probe's first batch came from; without them, as on resume, at ``own``). Then the
    loader was built before the size was set, or does not read it (``batch_size=64`` written in),
    and ``fit`` would train at its old size. Several loaders at multiples of the size (a
    semi-supervised ``7 * B``) pass where any of them changed; a loader whose batch size is
    unknown (None) passes."""
    if not isinstance(size, int) or size < 1 or not isinstance(own, int) or isinstance(own, bool) or own == size:
        return
    combined = trainer.fit_loop._combined_loader
    if combined is None:
        return
    sizes = tuple(loader_batch_size(loader) for loader in combined.flattened)
    old = before if before is not None and len(before) == len(sizes) else (own,) * len(sizes)
    if not sizes or None in sizes or sizes != old:
        return
    where = "datamodule" if trainer.datamodule is not None else "module"
    batches = " and ".join(str(found) for found in sizes)
    raise ValueError(
        f"AutoBatchSize set {name}={size} (it was {own}), but the train dataloader fit got from the {where}'s "
        f"train_dataloader() still batches at {batches}, as before: it was built before the size was set (in "
        f"setup() or __init__) or does not read {name}, so fit would train at the old size. Build the DataLoader "
        f"inside train_dataloader() from self.{name} (Lightning calls it again after the size is set), as "
        "Lightning's BatchSizeFinder also requires"
    )


def undo_reloaded_draw(saved: torch.Tensor | None) -> None:
    """At ``on_train_start``: put the global RNG back to ``saved`` (its state when ``on_fit_start``
    ended) where the only draw since is the one seed ``fit``'s re-created train iterator took (its
    ``_BaseDataLoaderIter`` draws one int64), so the shuffle draws what ``fit`` without the callback
    draws. Anything else drawn since (a callback's own randomness) is left as it is."""
    if saved is None:
        return
    now = torch.get_rng_state()
    torch.set_rng_state(saved)
    torch.empty((), dtype=torch.int64).random_()  # the draw a DataLoader iterator makes
    torch.set_rng_state(saved if torch.equal(torch.get_rng_state(), now) else now)
