"""``AutoBatchSize``: a Lightning callback that sets the batch size from autobatch's probe.

At fit start it probes the module's real training step, the one ``fit`` will run: the module's
``training_step`` (through the strategy, under the precision plugin), ``backward`` and the
optimizer step from ``configure_optimizers`` (with the precision plugin's gradient scaler and
clipping), on batches of any size built from the first batch of the train dataloader. The
search is :func:`~autobatch.find_max_batch` (the exact boundary in a handful of trials, where
Lightning's ``BatchSizeFinder`` doubles and may stop at a power of two). The size goes where
``BatchSizeFinder`` puts it (``model.batch_size``, ``model.hparams.batch_size`` or the
datamodule's, found with Lightning's ``lightning_hasattr``), and the train dataloader is
re-created at it, never larger than the train dataset (as ``BatchSizeFinder``). The module,
its optimizers, the scaler, the learning-rate schedulers and the random states are put back
bit-exactly after the trials; no checkpoint file is written. Dataloaders passed to ``fit()``
directly are refused, as ``BatchSizeFinder`` refuses them: their batch size is fixed.

With ``global_batch`` the callback keeps that many samples per optimizer step: it sets
``trainer.accumulate_grad_batches`` and a batch size no larger than the probed one with
``batch × accumulation × world size == global_batch``.

Requires ``lightning`` (``pip install autobatch[lightning]``).
"""

from __future__ import annotations

import logging
from contextlib import ExitStack, contextmanager, nullcontext
from copy import deepcopy
from typing import Any, Callable, Iterator, Mapping

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr

from ..memory.devices import memory_for
from ..memory.simulated import host_memory
from ..memory.units import parse_bytes
from ..planning.accumulation import take_samples
from ..probe.find import find_max_batch
from ..probe.restore import Snapshot
from ..probe.result import ProbeResult
from ..probe.search import peak_limit
from ..training.batch_ops import map_tensors
from ..training.checkpoint_io import rng_state, set_rng_state
from .global_batch import accumulation_for
from .lightning_loop import LoopConfirmation, MemoryLine, confirm_in_loop

__all__ = ["AutoBatchSize", "accumulation_for"]

log = logging.getLogger("autobatch")


class AutoBatchSize(Callback):
    """Probe the largest batch that trains at fit start, confirm it in Lightning's loop, set it.

    Args:
        batch_arg_name: the attribute holding the batch size (as ``BatchSizeFinder``).
        memory_limit, margin, multiple_of, max_batch, strategy, steps_per_trial: passed to
            :func:`~autobatch.find_max_batch` (``memory_limit`` caps the probe and the
            confirmation: "16GiB").
        global_batch: keep this many samples per optimizer step over all ranks through
            ``accumulate_grad_batches`` (None: leave accumulation alone).
        confirm: after the probe, run ``confirm_steps`` optimizer steps of the trainer's own fit
            loop at the answer, and step down from measurements if the loop runs out of memory
            (:mod:`autobatch.integrations.lightning_loop`). Skipped on more than one rank: an OOM
            on one rank inside the loop's gradient all-reduce would leave the others waiting.
        probe_options: further keyword arguments for ``find_max_batch``.

    After fit start, ``result`` is the :class:`~autobatch.ProbeResult`, ``confirmation`` the
    :class:`~autobatch.integrations.lightning_loop.LoopConfirmation` (its ``summary()`` says why
    the size is safe; also in ``result.notes``), ``batch_size`` the size set and
    ``accumulation`` the ``accumulate_grad_batches`` set (or None).
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
        confirm: bool = True,
        confirm_steps: int = 3,
        probe_options: Mapping[str, Any] | None = None,
    ) -> None:
        if global_batch is not None and (isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1):
            raise ValueError(f"global_batch must be a positive integer or None, got {global_batch!r}")
        if isinstance(confirm_steps, bool) or not isinstance(confirm_steps, int) or confirm_steps < 1:
            raise ValueError(f"confirm_steps must be a positive integer, got {confirm_steps!r}")
        self.batch_arg_name = batch_arg_name
        self.global_batch = global_batch
        self.confirm, self.confirm_steps = bool(confirm), confirm_steps
        self.memory_limit = None if memory_limit is None else parse_bytes(memory_limit, name="memory_limit")
        self.probe_options = dict(
            memory_limit=memory_limit, margin=margin, multiple_of=multiple_of, max_batch=max_batch,
            strategy=strategy, steps_per_trial=steps_per_trial, **(probe_options or {}),
        )
        self.result: ProbeResult | None = None
        self.confirmation: LoopConfirmation | None = None
        self.batch_size: int | None = None
        self.accumulation: int | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        name = self.batch_arg_name
        if not lightning_hasattr(pl_module, name):
            raise AttributeError(
                f"AutoBatchSize: no field {name!r} in the module, its hparams or the datamodule; add it "
                "(and build the train dataloader from it) or pass batch_arg_name"
            )
        if not trainer.fit_loop._data_source.is_module():
            raise ValueError(
                "AutoBatchSize cannot set the batch size of dataloaders passed to fit() directly (they are built "
                "already): build the train dataloader in the module's or datamodule's train_dataloader() from "
                f"{name!r}, as Lightning's BatchSizeFinder requires"
            )
        world = max(1, trainer.world_size)
        options = dict(self.probe_options)
        share = None
        if self.global_batch is not None:
            if not pl_module.automatic_optimization:  # Lightning accumulates only for automatic optimization
                raise ValueError(
                    f"global_batch={self.global_batch} needs gradient accumulation, which Lightning does not do under "
                    "manual optimization (automatic_optimization=False: your training_step steps the optimizers); "
                    "drop global_batch, or accumulate in your training_step"
                )
            if self.global_batch % world:
                raise ValueError(f"global_batch={self.global_batch} does not split over {world} ranks; use a multiple")
            share = self.global_batch // world
            options["max_batch"] = min(options["max_batch"] or share, share)
        saved = rng_state()  # a DataLoader's iterator draws its seed: fit must draw the same
        first, sized, samples = _first_batch(trainer, pl_module)
        set_rng_state(saved)
        if samples is not None and self.global_batch is not None and self.global_batch > samples:
            raise ValueError(  # an epoch would end first: every optimizer step would train fewer samples
                f"global_batch={self.global_batch} is larger than the train dataset ({samples} samples): each epoch "
                "would end before one global batch; lower global_batch"
            )
        if samples is not None:  # as BatchSizeFinder: no batch larger than the dataset
            options["max_batch"] = min(options["max_batch"] or samples, samples)
        step = _LightningStep(trainer, pl_module, first, accumulating=share is not None and share > 1, prefetch=not sized)
        with _saved_state(trainer, pl_module) as reset:
            with _muted(pl_module):
                self.result = find_max_batch(step, device=pl_module.device, **options)
            del step, first
            reset()
            self.batch_size, self.accumulation = self._apply(trainer, pl_module, share, self.result.batch_size)
            if self.confirm and world == 1:
                self._confirm(trainer, pl_module, share, reset)
            elif self.confirm:
                self.confirmation = LoopConfirmation(self.batch_size, self.result.batch_size, None, skipped=(
                    f"{world} ranks: an OOM on one rank inside the loop's gradient all-reduce would leave the others waiting"))
        set_rng_state(saved)
        if world > 1:  # every rank trains the same size (find_max_batch agreed already; this is the guard)
            from ..dist.agreement import agree_min, is_distributed

            if is_distributed():
                agreed = agree_min(self.batch_size, "AutoBatchSize batch size")
                if agreed != self.batch_size:
                    self.batch_size, self.accumulation = self._apply(trainer, pl_module, share, agreed)
        if self.confirmation is not None:
            self.result.notes.append(self.confirmation.summary())
        trainer.fit_loop._combined_loader = None  # the train dataloader is re-created at the new size
        log.info("AutoBatchSize: %s=%d (probe %d%s)", name, self.batch_size, self.result.batch_size,
                 f", accumulate_grad_batches={self.accumulation}" if self.accumulation else "")

    def _apply(self, trainer: Trainer, module: LightningModule, share: int | None, largest: int) -> tuple[int, int | None]:
        """Set the batch size (and accumulation) for a largest micro-batch; return them."""
        multiple = self.probe_options["multiple_of"]
        size, accumulation = max(1, largest // multiple * multiple) if largest >= multiple else 0, None
        if share is not None and largest >= 1:
            accumulation, size = accumulation_for(share, largest)
            trainer.accumulate_grad_batches = accumulation
        if size >= 1:
            lightning_setattr(module, self.batch_arg_name, size)
        return size, accumulation

    def _confirm(self, trainer: Trainer, module: LightningModule, share: int | None, reset: Callable[[], None]) -> None:
        def apply(largest: int) -> tuple[int, int]:
            size, accumulation = self._apply(trainer, module, share, largest)
            return size, accumulation or trainer.accumulate_grad_batches

        with memory_for(module.device, self.memory_limit) as (memory, _):
            capacity = memory.capacity()
            self.confirmation = confirm_in_loop(
                trainer, self.batch_size, probed=self.result.batch_size, line=MemoryLine.of(self.result),
                memory=memory, limit=peak_limit(memory, capacity), apply=apply, reset=reset, steps=self.confirm_steps,
            )
        self.batch_size, self.accumulation = self._apply(trainer, module, share, self.confirmation.batch_size)


class _LightningStep:
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
    """

    def __init__(self, trainer: Trainer, module: LightningModule, first: Any, *, accumulating: bool = False,
                 prefetch: bool = False) -> None:
        self.trainer, self.module, self.first, self.prefetch = trainer, module, first, prefetch
        self.available = _size_of(first)
        self.accumulating = accumulating or trainer.accumulate_grad_batches > 1
        self._with_grads: list[torch.nn.Parameter] = []  # parameters the last backward gave a gradient

    def __call__(self, batch_size: int) -> None:
        index = torch.arange(batch_size) % self.available
        # tensors and per-sample lists (label names, raw text a training_step tokenizes) alike
        batch, *ahead = [take_samples(self.first, index, self.available) for _ in range(1 + self.prefetch)]
        # ``ahead``: Lightning's fetcher loads the next batch while this one runs when the train
        # dataloader has no length (an iterable dataset; with a length it prefetches nothing):
        # host memory on an accelerator, the same memory on the CPU
        trainer, module = self.trainer, self.module
        batch = trainer.strategy.batch_to_device(batch)
        model = trainer.strategy.model
        sync = model.no_sync() if hasattr(model, "no_sync") else nullcontext()  # trials run no collective
        with sync:
            if not module.automatic_optimization:
                trainer.strategy.training_step(batch, 0)  # it steps its optimizers itself
                return
            self._previous_gradients()
            optimizer = trainer.optimizers[0]
            held: dict[str, Any] = {}

            def closure() -> torch.Tensor:
                out = held["out"] = trainer.strategy.training_step(batch, 0)  # the ClosureResult keeps it
                loss = out["loss"] if isinstance(out, Mapping) else out
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

    def _previous_gradients(self) -> None:
        """Give back the gradients a previous step left (the loop's steady state), where a failed
        trial or ``zero_grad`` dropped them: same shapes, same memory."""
        for param in self._with_grads:
            if param.grad is None:
                param.grad = torch.zeros_like(param)


@contextmanager
def _saved_state(trainer: Trainer, module: LightningModule) -> Iterator[Callable[[], None]]:
    """Snapshots of the module, every optimizer, the precision plugin's scaler, the learning-rate
    schedulers and the random states; yields ``reset()`` (put them back, as often as needed) and resets on the way out."""
    optimizers = list(trainer.optimizers) or [None]
    with host_memory():  # host copies: on an accelerator they take none of its memory
        snapshots = [Snapshot.take(module if i == 0 else None, opt) for i, opt in enumerate(optimizers)]
        randoms = rng_state()
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    scaler_state = None if scaler is None else scaler.state_dict()
    # the confirmation's loop runs step the schedulers: OneCycleLR would run out of steps in fit
    schedulers = [(config.scheduler, deepcopy(config.scheduler.state_dict())) for config in trainer.lr_scheduler_configs]

    def reset() -> None:
        for snapshot in reversed(snapshots):
            snapshot.restore()
        if scaler is not None:
            from torch.amp.grad_scaler import _refresh_per_optimizer_state

            scaler.load_state_dict(scaler_state)
            scaler._per_optimizer_states.clear()
            scaler._per_optimizer_states.default_factory = _refresh_per_optimizer_state
        for scheduler, state in schedulers:
            scheduler.load_state_dict(deepcopy(state))
        set_rng_state(randoms)

    try:
        yield reset
    finally:
        reset()


@contextmanager
def _muted(module: LightningModule) -> Iterator[None]:
    """The module's ``log``/``log_dict`` do nothing during the probe (no loop runs to receive them)."""
    with ExitStack() as stack:
        for name in ("log", "log_dict"):
            setattr(module, name, lambda *args, **kwargs: None)
            stack.callback(delattr, module, name)
        yield


def _first_batch(trainer: Trainer, module: LightningModule) -> tuple[Any, bool, int | None]:
    """The train dataloader's first batch, whether the dataloader has a length, and how many
    samples its dataset holds (None: unknown)."""
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
    try:
        sized = len(loader) >= 0
    except TypeError:
        sized = False
    try:
        samples = len(loader.dataset)
    except (AttributeError, TypeError):
        samples = None
    return batch, sized, samples


def _size_of(batch: Any) -> int:
    sizes: set[int] = set()
    map_tensors(batch, lambda t: sizes.add(t.shape[0]) or t)
    if len(sizes) != 1:
        raise ValueError(f"AutoBatchSize: the batch's tensors must share dim 0 (the batch); got sizes {sorted(sizes)}")
    return sizes.pop()


def current_batch_size(module: LightningModule, name: str = "batch_size") -> Any:
    """The batch size where ``BatchSizeFinder`` reads it (``lightning_getattr``)."""
    return lightning_getattr(module, name)
