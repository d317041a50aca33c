"""The training step :class:`~autobatch.integrations.lightning.AutoBatchSize` probes, and its first batch.

The step does what Lightning's training loop does with a batch (``training_epoch_loop.py`` and
``_AutomaticOptimization``): the precision plugin's ``convert_input`` (a ``"64-true"`` or
``"bf16-true"`` run casts the batch), the module's (or datamodule's) ``on_before_batch_transfer``,
the strategy's ``batch_to_device`` with ``transfer_batch_to_device`` and
``on_after_batch_transfer``, then ``training_step``, ``backward`` and the optimizer step.
The first batch comes from the train dataloader(s) as Lightning combines them
(``CombinedLoader``, ``"max_size_cycle"``), before any of those hooks.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Mapping

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from lightning.pytorch.utilities.parsing import _lightning_get_all_attr_holders

from ..planning.samples import cycle_samples
from ..probe.snapshot.restore_places import forget_scaler_stage
from ..training.batch_ops import map_tensors
from .lightning_loaders import loader_batch_size
from .lightning_longest import longest_batch
from .trial_settings import sized_for_trial

__all__ = ["LightningStep", "first_batch", "size_of", "trial_size"]

#: batch indices a probe step tries while ``training_step`` returns None (Lightning skips the batch)
SKIPPED_BATCHES = 3


class LightningStep:
    """``fn(batch_size)``: one training step of the module at ``batch_size``, as Lightning's
    automatic-optimization loop runs it (``_AutomaticOptimization``'s ``Closure``).

    What the loop holds, and so this step too (measured on the simulated device, see
    docs/integrations.md): the previous step's gradients stay alive through the forward pass,
    because the loop calls ``optimizer_zero_grad`` *after* ``training_step`` and before
    ``backward`` (a step that zeroes first, as a plain PyTorch loop does, misses them: for a
    GPT with a large vocabulary that is the weight of the embedding and the head, about one
    sample at the boundary); the ``training_step`` output (loss and any extra tensors
    returned in its dict) lives until the optimizer step has run; the loss is divided by
    ``accumulate_grad_batches``; and while accumulating (``accumulating``), no micro-batch but
    the first of a window zeroes the gradients, so the old ones stay alive through
    ``backward`` too and the optimizer step follows it.

    ``restore()`` runs before each step: it puts the module's plain attributes back (outputs a
    ``training_step`` gathers, counters), so what a step keeps does not pile up over the trials;
    what the loop keeps batch after batch is the confirmation's to measure.

    ``name``: the batch attribute (``batch_arg_name``), set to the trial's size while it runs and
    put back after (:func:`trial_size`), as ``fit`` has it at the size set.
    """

    def __init__(self, trainer: Trainer, module: LightningModule, first: Any, *, accumulating: bool = False,
                 prefetch: bool = False, restore: Callable[[], None] = lambda: None, loaders: int = 1,
                 own: Any = None, name: str | None = None) -> None:
        self.trainer, self.module, self.first, self.prefetch, self.name = trainer, module, first, prefetch, name
        # several train dataloaders may batch at different multiples of the batch size (a FixMatch
        # unlabeled loader at 7x): each part of the combined batch is resized in proportion
        self.parts = _loader_parts(first, own) if loaders > 1 else None
        self.available = size_of(first) if self.parts is None else 0
        self.accumulating = accumulating or trainer.accumulate_grad_batches > 1
        self.restore = restore
        self.index = 0  # the batch_idx passed to training_step: the first one it does not skip
        self._with_grads: list[torch.nn.Parameter] = []  # parameters the last backward gave a gradient

    def __call__(self, batch_size: int) -> None:
        self.restore()
        with trial_size(self.module, self.name, batch_size):
            self._step(batch_size)

    def _step(self, batch_size: int) -> None:
        self._forget_unscaled()
        # tensors and per-sample lists (label names, raw text a training_step tokenizes) alike;
        # cut, not indexed, so an estimate's fake tensors can build it too
        batch, *ahead = [self._resized(batch_size) for _ in range(1 + self.prefetch)]
        # ``ahead``: Lightning's fetcher loads the next batch while this one runs when the train
        # dataloader has no length (an iterable dataset; with a length it prefetches nothing):
        # host memory on an accelerator, the same memory on the CPU
        trainer, module = self.trainer, self.module
        batch = trainer.precision_plugin.convert_input(batch)  # as the loop, in this order
        batch = module._on_before_batch_transfer(batch, dataloader_idx=0)
        batch = call._call_strategy_hook(trainer, "batch_to_device", batch, dataloader_idx=0)
        model = trainer.strategy.model
        sync = model.no_sync() if hasattr(model, "no_sync") else nullcontext()  # trials run no collective
        with sync:
            if not module.automatic_optimization:
                trainer.strategy.training_step(batch, self.index)  # it steps its optimizers itself
                return
            self._previous_gradients()
            optimizer = trainer.optimizers[0]
            held: dict[str, Any] = {}

            def closure() -> torch.Tensor:
                out = held["out"] = self._training_step(batch)  # the ClosureResult keeps it
                loss = _loss_of(out)
                if trainer.accumulate_grad_batches > 1:
                    loss = loss / trainer.accumulate_grad_batches
                held["loss"] = loss.detach().clone()
                if not self.accumulating:
                    call._call_lightning_module_hook(trainer, "optimizer_zero_grad", trainer.current_epoch, 0, optimizer)
                trainer.strategy.backward(loss, optimizer)
                return held["loss"]

            trainer.strategy.optimizer_step(optimizer, closure=closure)
            self._with_grads = [p for p in module.parameters() if p.grad is not None]
        del ahead, held

    def _resized(self, batch_size: int) -> Any:
        """The first batch at ``batch_size``; with several loaders, each loader's part at its own
        multiple of it (rounded, at least 1)."""
        if self.parts is None:
            return cycle_samples(self.first, batch_size, self.available)
        own, sizes = self.parts
        keys = self.first.keys() if isinstance(self.first, Mapping) else range(len(self.first))
        resized = {key: cycle_samples(self.first[key], max(1, round(sizes[key] * batch_size / own)), sizes[key])
                   for key in keys}
        return resized if isinstance(self.first, Mapping) else type(self.first)(resized[key] for key in keys)

    def _forget_unscaled(self) -> None:
        """Mark every optimizer unscaled again in the precision plugin's ``GradScaler`` ("16-mixed"):
        no step is under way when a trial starts, so a mark is a failed trial's. Why: the plugin
        calls ``scaler.unscale_(optimizer)`` before ``on_before_optimizer_step``, the gradient
        clipping and the optimizer step, and a trial that ran out of memory there left the mark,
        so the next trial's ``unscale_`` raised "unscale_() has already been called on this
        optimizer since the last update()" and ended the probe."""
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled():
            for optimizer in self.trainer.optimizers:
                forget_scaler_stage(scaler, optimizer)

    def _training_step(self, batch: Any) -> Any:
        """The module's ``training_step`` output at the first batch index it does not skip (a
        module may return None for batch 0, as a data-dependent initialisation does)."""
        for index in range(self.index, self.index + SKIPPED_BATCHES):
            out = self.trainer.strategy.training_step(batch, index)
            if out is not None:
                self.index = index
                return out
        raise ValueError(
            f"AutoBatchSize: training_step returned None (Lightning skips the batch) for batch_idx {self.index} to "
            f"{self.index + SKIPPED_BATCHES - 1}: the probe needs a step that trains; return the loss for at least "
            "one of the first batches, or set the batch size yourself"
        )

    def _previous_gradients(self) -> None:
        """Give back the gradients a previous step left (the loop's steady state), where a failed
        trial or ``zero_grad`` dropped them: same shapes, same memory."""
        for param in self._with_grads:
            if param.grad is None:
                param.grad = torch.zeros_like(param)


@contextmanager
def trial_size(module: LightningModule, name: str | None, batch_size: int) -> Iterator[None]:
    """The batch attribute ``name`` set to ``batch_size`` wherever ``lightning_setattr`` sets it
    (the module, its ``hparams``, the datamodule, its ``hparams``) while a trial runs, each put
    back after it, on error too (:mod:`~autobatch.integrations.trial_settings`). Why: a
    ``training_step`` that reads it (a GAN's noise, ``torch.randn(self.hparams.batch_size,
    latent)``; labels ``torch.ones(self.batch_size, 1)``) got the module's own size in a trial of
    another, or measured a step smaller than the one ``fit`` runs."""
    holders = [] if name is None else _lightning_get_all_attr_holders(module, name)
    with sized_for_trial([(holder, name) for holder in holders], batch_size):
        yield


def _loss_of(out: Any) -> torch.Tensor:
    """The loss in a ``training_step`` output, as Lightning's ``ClosureResult`` reads it."""
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if isinstance(out, Mapping) and loss is None:
        raise ValueError(
            f"AutoBatchSize: training_step returned a dict without a 'loss' key (keys: {sorted(map(str, out))}); "
            "under automatic optimization Lightning needs it too: return {'loss': loss, ...}"
        )
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            f"AutoBatchSize: training_step returned {type(out).__name__}; return the loss tensor, a dict with a "
            "'loss' key, or None to skip the batch"
        )
    return loss


def first_batch(trainer: Trainer, module: LightningModule,
                world: int) -> tuple[Any, bool, int | None, int, bool, tuple[int | None, ...]]:
    """The train dataloader's first batch, whether the dataloader has a length, how many samples
    each of ``world`` ranks trains per epoch (None: unknown), how many dataloaders it combines,
    whether one of them drops its last partial batch (``drop_last``), and each one's batch size
    (:func:`~.lightning_loaders.loader_batch_size`: a loader that does not follow the size set is
    one error at ``on_train_start``).

    Several train dataloaders (a dict or list of them) are combined as ``fit`` combines them; the
    samples are the smallest dataset's, as a batch larger than any of them would not fill. One loader whose
    samples vary in size gives its longest beside its shortest instead (:func:`~.lightning_longest.longest_batch`)."""
    source = trainer.datamodule if trainer.datamodule is not None else module
    try:
        loader = source.train_dataloader()
    except Exception as exc:  # noqa: BLE001 - re-raised with what to do
        raise RuntimeError(
            "AutoBatchSize builds the train dataloader from the module's or datamodule's train_dataloader(); "
            f"it failed ({type(exc).__name__}: {exc}). Dataloaders passed to fit() directly have a fixed batch size."
        ) from exc
    combined = loader if isinstance(loader, CombinedLoader) else CombinedLoader(loader, "max_size_cycle")
    try:
        batch, _, _ = next(iter(combined))
        batch = longest_batch(loader, batch) if len(combined.flattened) == 1 else batch  # padded to the set's longest
        sized = _has_length(combined)
    except StopIteration:
        raise ValueError("AutoBatchSize: the train dataloader yielded no batch") from None
    finally:
        combined.reset()  # its workers, if any, shut down
    shares = [_share_of(part, world, trainer) for part in combined.flattened]
    drops = any(getattr(part, "drop_last", False) or getattr(getattr(part, "batch_sampler", None), "drop_last", False)
                for part in combined.flattened)
    sizes = tuple(loader_batch_size(part) for part in combined.flattened)
    return batch, sized, None if not shares or None in shares else min(shares), len(combined.flattened), drops, sizes


def _has_length(combined: CombinedLoader) -> bool:
    try:
        return len(combined) >= 0
    except TypeError:  # a dataloader without a length (an iterable dataset): the fetcher prefetches
        return False


def _share_of(loader: Any, world: int, trainer: Trainer) -> int | None:
    """Samples of ``loader`` each of ``world`` ranks trains per epoch: a ``DistributedSampler``'s
    length; under more than one rank, where Lightning gives the loader one (its
    ``use_distributed_sampler``, the default), the dataset split over the ranks."""
    from torch.utils.data.distributed import DistributedSampler

    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, DistributedSampler):
        return len(sampler)
    try:
        samples = len(loader.dataset)
    except (AttributeError, TypeError):
        return None
    if world > 1 and getattr(trainer._accelerator_connector, "use_distributed_sampler", True):
        return max(1, samples // world)
    return samples


def _loader_parts(first: Any, own: Any) -> tuple[int, dict[Any, int]] | None:
    """For a batch combined from several train dataloaders (a dict or list of their batches): the
    batch size the first batch was built at and each part's size, or None where every part has the
    same size (resized as one batch). Why: a module batching a second loader at a multiple of its
    batch size (semi-supervised: labeled ``B``, unlabeled ``7 * B``) was refused ("must share dim
    0"). The batch attribute's value when the first batch was built (``own``) is the reference (a
    part at ``2 * own`` is probed at ``2 * B``); without one, the smallest part."""
    if not isinstance(first, (Mapping, list, tuple)) or not first:
        return None
    items = first.items() if isinstance(first, Mapping) else enumerate(first)
    sizes = {key: size_of(part) for key, part in items}
    if len(set(sizes.values())) == 1:
        return None
    usable = isinstance(own, int) and not isinstance(own, bool) and own >= 1
    return (own if usable else min(sizes.values())), sizes


def size_of(batch: Any) -> int:
    """The batch's size: dim 0 of its tensors (one error where they disagree)."""
    sizes: set[int] = set()
    map_tensors(batch, lambda t: sizes.add(t.shape[0]) or t)
    if len(sizes) != 1:
        raise ValueError(f"AutoBatchSize: the batch's tensors must share dim 0 (the batch); got sizes {sorted(sizes)}. "
                         "Make a sequence-first tensor batch-first (.transpose(0, 1)), and keep a tensor shared by the "
                         "whole batch (class weights, a mask) on the module rather than in the batch")
    return sizes.pop()
