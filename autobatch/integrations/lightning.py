"""``AutoBatchSize``: a Lightning callback that sets the batch size from autobatch's probe.

At fit start it probes the module's real training step, the one ``fit`` will run: the module's
``training_step`` (through the strategy, under the precision plugin), ``backward`` and the
optimizer step from ``configure_optimizers`` (with the precision plugin's gradient scaler and
clipping), on batches of any size built from the first batch of the train dataloader. The
search is :func:`~autobatch.find_max_batch` (the exact boundary in a handful of trials, where
Lightning's ``BatchSizeFinder`` doubles and may stop at a power of two). The size goes where
``BatchSizeFinder`` puts it (``model.batch_size``, ``model.hparams.batch_size`` or the
datamodule's, found with Lightning's ``lightning_hasattr``), and the train dataloader is
re-created at it. The module, its optimizers, the scaler and the random states are put back
bit-exactly after the trials; no checkpoint file is written.

With ``global_batch`` the callback keeps that many samples per optimizer step: it sets
``trainer.accumulate_grad_batches`` and a batch size no larger than the probed one with
``batch × accumulation × world size == global_batch``.

Requires ``lightning`` (``pip install autobatch[lightning]``).
"""

from __future__ import annotations

import logging
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any, Iterator, Mapping

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr

from ..probe.find import find_max_batch
from ..probe.restore import Snapshot
from ..probe.result import ProbeResult
from ..training.batch_ops import map_tensors
from ..training.checkpoint_io import rng_state, set_rng_state
from .global_batch import accumulation_for

__all__ = ["AutoBatchSize", "accumulation_for"]

log = logging.getLogger("autobatch")


class AutoBatchSize(Callback):
    """Probe the largest batch that trains at fit start and set it (a ``Callback``).

    Args:
        batch_arg_name: the attribute holding the batch size (as ``BatchSizeFinder``).
        memory_limit, margin, multiple_of, max_batch, strategy, steps_per_trial: passed to
            :func:`~autobatch.find_max_batch` (``memory_limit`` caps the probe: "16GiB").
        global_batch: keep this many samples per optimizer step over all ranks through
            ``accumulate_grad_batches`` (None: leave accumulation alone).
        probe_options: further keyword arguments for ``find_max_batch``.

    After fit start, ``result`` is the :class:`~autobatch.ProbeResult`, ``batch_size`` the size
    set and ``accumulation`` the ``accumulate_grad_batches`` set (or None).
    """

    def __init__(
        self,
        *,
        batch_arg_name: str = "batch_size",
        memory_limit: int | str | None = None,
        margin: float = 0.0,
        multiple_of: int = 1,
        max_batch: int | None = None,
        strategy: str = "auto",
        steps_per_trial: int = 3,
        global_batch: int | None = None,
        probe_options: Mapping[str, Any] | None = None,
    ) -> None:
        if global_batch is not None and (isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1):
            raise ValueError(f"global_batch must be a positive integer or None, got {global_batch!r}")
        self.batch_arg_name = batch_arg_name
        self.global_batch = global_batch
        self.probe_options = dict(
            memory_limit=memory_limit, margin=margin, multiple_of=multiple_of, max_batch=max_batch,
            strategy=strategy, steps_per_trial=steps_per_trial, **(probe_options or {}),
        )
        self.result: ProbeResult | None = None
        self.batch_size: int | None = None
        self.accumulation: int | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        name = self.batch_arg_name
        if not lightning_hasattr(pl_module, name):
            raise AttributeError(
                f"AutoBatchSize: no field {name!r} in the module, its hparams or the datamodule; add it "
                "(and build the train dataloader from it) or pass batch_arg_name"
            )
        world = max(1, trainer.world_size)
        options = dict(self.probe_options)
        if self.global_batch is not None:
            if self.global_batch % world:
                raise ValueError(f"global_batch={self.global_batch} does not split over {world} ranks; use a multiple")
            share = self.global_batch // world
            options["max_batch"] = min(options["max_batch"] or share, share)
        saved = rng_state()  # a DataLoader's iterator draws its seed: fit must draw the same
        first = _first_batch(trainer, pl_module)
        set_rng_state(saved)
        with _probing(trainer, pl_module):
            self.result = find_max_batch(_LightningStep(trainer, pl_module, first), device=pl_module.device, **options)
        size = self.result.batch_size
        if self.global_batch is not None:
            self.accumulation, size = accumulation_for(self.global_batch // world, size)
            trainer.accumulate_grad_batches = self.accumulation
        self.batch_size = size
        lightning_setattr(pl_module, name, size)
        trainer.fit_loop._combined_loader = None  # the train dataloader is re-created at the new size
        log.info("AutoBatchSize: %s=%d (probe %d%s)", name, size, self.result.batch_size,
                 f", accumulate_grad_batches={self.accumulation}" if self.accumulation else "")


class _LightningStep:
    """``fn(batch_size)``: one real training step of the module at ``batch_size``."""

    def __init__(self, trainer: Trainer, module: LightningModule, first: Any) -> None:
        self.trainer, self.module, self.first = trainer, module, first
        self.available = _size_of(first)

    def __call__(self, batch_size: int) -> None:
        index = torch.arange(batch_size) % self.available
        batch, ahead = (map_tensors(self.first, lambda t: t.index_select(0, index.to(t.device))) for _ in range(2))
        # ``ahead`` stands for the batch Lightning's fetcher has already loaded for the next
        # step while this one runs: host memory on an accelerator, the same memory on the CPU
        trainer, module = self.trainer, self.module
        batch = trainer.strategy.batch_to_device(batch)
        model = trainer.strategy.model
        sync = model.no_sync() if hasattr(model, "no_sync") else nullcontext()  # trials run no collective
        with sync:
            if not module.automatic_optimization:
                trainer.strategy.training_step(batch, 0)  # it steps its optimizers itself
                return
            optimizer = trainer.optimizers[0]

            def closure() -> torch.Tensor:
                optimizer.zero_grad(set_to_none=True)
                out = trainer.strategy.training_step(batch, 0)
                loss = out["loss"] if isinstance(out, Mapping) else out
                trainer.strategy.backward(loss, optimizer)
                return loss.detach()

            trainer.strategy.optimizer_step(optimizer, closure=closure)
        del ahead
        for opt in trainer.optimizers:
            opt.zero_grad(set_to_none=True)

    def clear_grads(self) -> None:
        for opt in self.trainer.optimizers:
            opt.zero_grad(set_to_none=True)
        for param in self.module.parameters():
            param.grad = None


@contextmanager
def _probing(trainer: Trainer, module: LightningModule) -> Iterator[None]:
    """Snapshots of the module, every optimizer and the precision plugin's scaler, put back
    afterwards; logging from the module is muted (no loop is running to receive it)."""
    optimizers = list(trainer.optimizers) or [None]
    snapshots = [Snapshot.take(module if i == 0 else None, opt) for i, opt in enumerate(optimizers)]
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    scaler_state = None if scaler is None else scaler.state_dict()
    with ExitStack() as stack:
        for name in ("log", "log_dict"):
            setattr(module, name, lambda *args, **kwargs: None)
            stack.callback(delattr, module, name)
        try:
            yield
        finally:
            for snapshot in reversed(snapshots):
                snapshot.restore()
            if scaler is not None:
                from torch.amp.grad_scaler import _refresh_per_optimizer_state

                scaler.load_state_dict(scaler_state)
                scaler._per_optimizer_states.clear()
                scaler._per_optimizer_states.default_factory = _refresh_per_optimizer_state


def _first_batch(trainer: Trainer, module: LightningModule) -> Any:
    source = trainer.datamodule if trainer.datamodule is not None else module
    try:
        loader = source.train_dataloader()
    except Exception as exc:  # noqa: BLE001 - re-raised with what to do
        raise RuntimeError(
            "AutoBatchSize builds the train dataloader from the module's or datamodule's train_dataloader(); "
            f"it failed ({type(exc).__name__}: {exc}). Dataloaders passed to fit() directly have a fixed batch size."
        ) from exc
    batch = next(iter(loader), None)
    if batch is None:
        raise ValueError("AutoBatchSize: the train dataloader yielded no batch")
    return batch


def _size_of(batch: Any) -> int:
    sizes: set[int] = set()
    map_tensors(batch, lambda t: sizes.add(t.shape[0]) or t)
    if len(sizes) != 1:
        raise ValueError(f"AutoBatchSize: the batch's tensors must share dim 0 (the batch); got sizes {sorted(sizes)}")
    return sizes.pop()


def current_batch_size(module: LightningModule, name: str = "batch_size") -> Any:
    """The batch size where ``BatchSizeFinder`` reads it (``lightning_getattr``)."""
    return lightning_getattr(module, name)
