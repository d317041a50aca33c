"""Snapshot a model and its optimizer before trials that really train, and put them back.

Probe trials run real optimizer steps, so without a restore the model a user probes is not
the model they start training (Lightning users hit leaked optimizer state, #6570). The
snapshot lives in CPU memory so it takes nothing from the device being probed, and is taken
outside any simulated budget. Restoring is bit-exact: parameters (the model's, and those the
optimizer trains outside it, such as a CLIP loss module's ``logit_scale``), buffers, gradients,
optimizer state (including state that did not exist yet, such as Adam's moments before the
first step), training flags, the random number generators, a ``GradScaler``'s scale (fp16
trials whose gradients overflow halve it) and the state dicts of further objects the step
advances (an LR scheduler). What forward added to the module tree (a lazily registered mask, a
cache made again at another size) goes too (:mod:`.restore_places`), and so do the tensors it
kept as plain attributes (``self.mask = ...``: :mod:`.restore_attributes`).

Copying the weights off an accelerator is the slow part (measured on an H200: 0.07 s for
ResNet-50's 98 MiB, 0.32 s for GPT-2's 475 MiB, at ~1.5 GB/s into fresh host memory). With
``background=True`` the parameters and optimizer state are copied by a thread while the
first trial runs, and the optimizer's next ``step()`` waits for that copy (a step pre-hook):
in a :class:`~autobatch.TrainStep` nothing else writes them, except where forward does
(:func:`written_outside_the_optimizer`: an ``Embedding`` with ``max_norm`` renorms its rows, a
custom module may update a parameter the optimizer does not hold, as a vector quantizer's
moving-average codebook), and those are copied at once. So are buffers (which forward may
update, as BatchNorm's statistics), gradients, training flags and random states. The other
parameters the optimizer does not hold are copied first, before any forward (a MoCo key
encoder, a ``Linear`` forward moves, was caught half-way 1 run in 8; a frozen backbone waits too).

With ``zero_lr=True`` (a fresh optimizer of a kind whose every change to a parameter is scaled
by its group's learning rate, such as ``AdamW`` or ``SGD``) nothing of the weights is copied at
all: the trials step at learning rate 0, so the optimizer builds its state and allocates
every temporary of a real step while the weights stay as they are bit for bit (a step pre-hook
zeroes the gradients, so a NaN cannot make an update ``0 * nan``), and the restore drops the
state and puts the learning rates back. Weights holding a negative zero or a non-finite
value (which ``w + 0 * u`` may turn into a positive zero or another NaN), state that already
exists, a tensor learning rate or any other optimizer take the copy. Measured on an H200
(``scripts/bench_promise.py --timing-only``, 8 GiB cap): a ``TrainStep`` probe of GPT-2 took
0.83 s against Accelerate's 0.99 s, where with the copy it took 1.28 s against 1.08 s.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from ...memory.devices import simulated_counts
from ...memory.lazy_state import hooked
from ...memory.simulated import host_memory
from .restore_attributes import TensorAttributes
from .restore_places import (SCHEDULERS, all_params, attempt, counted_places, forget_scaler_stage, host_copy, layout_of,
                             load_keeping_groups, load_other, outside_the_model, places, put_back_layout,
                             put_back_requires_grad, written_outside_the_optimizer)
from .rng import rng_state, set_rng_state
from .shards import Shard, from_cpu_local, is_dtensor, local, to_cpu_local
from .zero_lr import _NEGATIVE_ZERO, _SCALED_BY_LR, _VersionsInStep, _zero_grads, _zero_lrs, steps_in_place_at_zero_lr  # noqa: F401

__all__ = ["Snapshot", "forget_scaler_stage", "steps_in_place_at_zero_lr", "written_outside_the_optimizer"]


def _to_cpu(value: Any) -> Any:
    """A CPU copy; a ``DTensor`` (FSDP2) keeps only this rank's local shard (:mod:`.shards`)."""
    return to_cpu_local(value, copy.deepcopy)


def _copy_local(tensor: torch.Tensor) -> torch.Tensor:
    return local(tensor).detach().to("cpu", copy=True)


@dataclass
class Snapshot:
    """What :meth:`take` copied; :meth:`restore` writes it back in place."""

    model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer | None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    grads: dict[str, torch.Tensor | Shard | None] = field(default_factory=dict)
    training: dict[str, bool] = field(default_factory=dict)
    requires_grad: dict[str, bool] = field(default_factory=dict)  # each parameter's (a GAN's step toggles them)
    optimizer_state: dict[str, Any] | None = None
    rng: dict[str, Any] | None = None  # every generator: torch's, Python's, NumPy's (make_batch may draw)

    _copier: threading.Thread | None = field(default=None, repr=False, compare=False)
    _copy_error: BaseException | None = field(default=None, repr=False, compare=False)
    _hook: Any = field(default=None, repr=False, compare=False)
    _copy_failed: bool = field(default=False, repr=False, compare=False)
    #: set once a background copy has the parameters outside the optimizer: forward waits (``_gate``)
    _outside: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)
    _gate: Any = field(default=None, repr=False, compare=False)
    _guard: Any = field(default=None, repr=False, compare=False)  # zero_lr: zeroes the gradients
    #: the trials step at learning rate 0: the parameters were not copied and need no restore
    weights_in_place: bool = False
    #: version counters of the parameters nothing copied at once (the optimizer's own too, at lr 0)
    _versions: dict[str, int] = field(default_factory=dict, repr=False, compare=False)
    _stepping: Any = field(default=None, repr=False, compare=False)  # lr 0: the bumps the optimizer made
    #: parameters the optimizer trains that the model does not hold (a loss's ``logit_scale``), by place
    extra: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)
    #: further objects the step advances (an LR scheduler; the scaler, whose scale fp16 trials whose
    #: gradients overflow halve), each with a host copy of its ``state_dict()``
    others: list[tuple[Any, Any]] = field(default_factory=list, repr=False, compare=False)
    #: every module's parameter, buffer and submodule names at take (:func:`layout_of`)
    _layout: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    #: places whose tensor an active simulated budget counted at take (:func:`counted_places`)
    _counted: set[tuple] = field(default_factory=set, repr=False, compare=False)
    #: the tensors the modules hold as plain attributes (:mod:`.restore_attributes`)
    attributes: TensorAttributes = field(default_factory=lambda: TensorAttributes(None), repr=False, compare=False)

    @classmethod
    def take(
        cls, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None = None, *,
        background: bool = False, scaler: Any = None, zero_lr: bool = False, others: tuple[Any, ...] = (),
        generators: tuple[Any, ...] = (),
    ) -> "Snapshot":
        """Copy the state to CPU memory. ``background``: copy the parameters and optimizer
        state in a thread, finished before the optimizer's next step (needs an optimizer; for
        a step that changes parameters only through it, such as a ``TrainStep``). ``zero_lr``:
        for such a step, when the optimizer allows it (:func:`steps_in_place_at_zero_lr`), set
        its learning rates to 0 until :meth:`restore` instead of copying the parameters.
        ``scaler``: a ``torch.amp.GradScaler`` whose scale and growth tracker are put back too.
        ``others``: objects with ``state_dict()``/``load_state_dict()`` the step advances (an LR
        scheduler a plain callable steps, a ``GradScaler``): their state dicts are copied too.
        ``generators``: the step's own random generators (:func:`~autobatch.probe.snapshot.rng.step_generators`),
        put back with the global ones.

        The copies are host memory (:func:`~autobatch.memory.simulated.host_memory`): inside a
        :func:`~autobatch.simulated_memory` block they take none of its budget, as on a GPU they
        take none of the device's, so a probe there answers what ``memory_limit`` of that size does."""
        with host_memory():
            snap = cls._take(model, optimizer, background=background, zero_lr=zero_lr, others=others)
            snap.rng = rng_state(own=generators)
            others = (scaler, *others) if scaler is not None and scaler.is_enabled() else others
            snap.others = [(other, host_copy(other.state_dict())) for other in others]
        return snap

    @classmethod
    def _take(cls, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None, *,
              background: bool, zero_lr: bool, others: tuple[Any, ...] = ()) -> "Snapshot":
        snap = cls(model=model, optimizer=optimizer)
        snap.extra = outside_the_model(model, optimizer, others)  # stepped as the model's are (at lr 0: left exact)
        snap.requires_grad = {name: param.requires_grad for name, param in all_params(model, snap.extra)}
        snap._counted, snap._layout = counted_places(model, optimizer, snap.extra), layout_of(model)
        snap.attributes = TensorAttributes(model, snap.extra.values())
        snap.weights_in_place = zero_lr and model is not None and steps_in_place_at_zero_lr(optimizer)
        background = background and optimizer is not None and not snap.weights_in_place
        eager: set[str] = set()  # parameters copied now although the thread copies, or nothing does
        everything = not (background or snap.weights_in_place)
        for name, param in snap.extra.items():
            if everything:
                snap.tensors[name] = _copy_local(param)
            snap.grads[name] = None if param.grad is None else _to_cpu(param.grad)
        if model is not None:
            if background or snap.weights_in_place:
                written = written_outside_the_optimizer(model, optimizer)
                eager = {name for name, param in model.named_parameters() if id(param) in written}
            for name, param in model.named_parameters():
                if everything or name in eager:
                    snap.tensors[name] = _copy_local(param)
            for name, buffer in _named_state(model, parameters=False):
                snap.tensors[name] = _copy_local(buffer)
            for name, param in model.named_parameters():
                snap.grads[name] = None if param.grad is None else _to_cpu(param.grad)
            if not everything:  # a write outside the optimizer would go unrestored: watch for one
                held = set() if optimizer is None else {id(p) for g in optimizer.param_groups for p in g["params"]}
                snap._versions = {name: param._version for name, param in model.named_parameters()
                                  if name not in eager and (id(param) not in held or snap.weights_in_place)}
            snap.training = {name: module.training for name, module in model.named_modules()}
        if not background:
            if optimizer is not None:
                snap.optimizer_state = _to_cpu(optimizer.state_dict())  # learning rates included
            if snap.weights_in_place:
                _zero_lrs(optimizer)
                snap._guard = hooked(optimizer).register_step_pre_hook(lambda opt, *_: _zero_grads(opt))
                snap._stepping = _VersionsInStep(optimizer)
            return snap
        # the hook only waits: removing itself while the optimizer runs its hooks would mutate
        # the dict being iterated (the probe's LazyStateWatch hooks the same step); wait() removes it
        snap._hook = hooked(optimizer).register_step_pre_hook(lambda *_: snap._join())
        devices = {param.device for group in optimizer.param_groups for param in group["params"]}
        # the copy runs on a stream of its own, after the work queued so far, so that it
        # overlaps the first trial's kernels instead of queueing them behind it
        after = {device: torch.cuda.current_stream(device) for device in devices if device.type == "cuda"}
        # the parameters as registered now: FSDP2 swaps full (unsharded) tensors into the
        # modules during a forward, which the thread must not mistake for the sharded ones
        params = [] if model is None else [(n, p) for n, p in model.named_parameters() if n not in eager]
        params += list(snap.extra.items())
        # those the optimizer does not hold first, before any forward, which may write one (MoCo)
        params.sort(key=lambda item: item[0] not in snap._versions)
        if any(name in snap._versions for name, _ in params):
            snap._gate = torch.nn.modules.module.register_module_forward_pre_hook(snap._before_forward)
        else:
            snap._outside.set()
        snap._copier = threading.Thread(
            target=snap._copy_catching, args=(after, params), name="autobatch-snapshot", daemon=True
        )
        snap._copier.start()
        return snap

    def _before_forward(self, *_: Any) -> None:
        """The global forward pre-hook (``_gate``): wait until the parameters outside the
        optimizer are copied, then remove itself. Left in place, every module of every forward
        ran through it until the restore, and a ``torch.compile``d model was not compiled at all
        (torch 2.13: dynamo compiled none of its frames with the hook in place): the trials
        measured the eager model."""
        self._outside.wait()
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.remove()  # safe mid-call: _call_impl iterates a copy of the global hooks
        # returns None: a forward pre-hook's value would replace the inputs

    def _copy_catching(self, after: dict[torch.device, Any], params: list[tuple[str, torch.Tensor]]) -> None:
        try:
            self._copy_in_background(after, params)
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits
            self._copy_error = exc
        finally:
            self._outside.set()  # a forward waiting on them goes on (a failed copy is raised at the step)

    def _copy_in_background(self, after: dict[torch.device, Any], params: list[tuple[str, torch.Tensor]]) -> None:
        with contextlib.ExitStack() as streams:
            for device, stream in after.items():
                side = torch.cuda.Stream(device=device)
                side.wait_stream(stream)
                streams.enter_context(torch.cuda.stream(side))
            for name, param in params:
                if name not in self._versions:
                    self._outside.set()  # the parameters outside the optimizer came first, and are copied
                self.tensors[name] = _copy_local(param)
            if self.optimizer is not None:
                self.optimizer_state = _to_cpu(self.optimizer.state_dict())

    def wait(self) -> None:
        """Block until a background copy is complete; re-raise its error, if any."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._gate is not None:
            self._gate.remove()
            self._gate = None
        self._join()

    def _join(self) -> None:
        if self._copier is not None:
            self._copier.join()
            self._copier = None
        if self._copy_error is not None:
            # raised before the optimizer step that waited, so the weights are unchanged
            error, self._copy_error, self._copy_failed = self._copy_error, None, True
            raise RuntimeError(f"autobatch could not snapshot the model before probing: {error}") from error

    def restore(self, *, keep: bool = False) -> None:
        """Write the snapshot back into the same objects (their identity is preserved).
        ``keep``: more trials follow (the planner times one candidate after another), so a
        ``zero_lr`` snapshot keeps its learning rates at 0; the last restore must not keep.

        Every stage runs even where one before it raised (the copy failed, the model changed in
        a way the snapshot cannot put back): the learning rates, the optimizer state, the other
        objects (the scaler) and the random generators are never left as the trials had them.
        The first error is raised once all ran. What is made again is host memory, as the
        copies were, and made again as device memory where a simulated budget counted it."""
        errors: list[BaseException] = []
        with host_memory():
            for stage in (self.wait, lambda: self._unguard(keep), self._restore_model,
                          lambda: self._restore_optimizer(keep), self._restore_others, lambda: set_rng_state(self.rng)):
                attempt(stage, errors)
        for stage in (self._recount, self.attributes.put_back):  # the latter after the buffers (an alias)
            attempt(stage, errors)
        if errors:
            raise errors[0]
        if not keep:
            self._warn_unrestored()

    def undo_forward(self) -> None:
        """Between trials: drop what forward registered and the tensors it kept as plain
        attributes (as :meth:`restore` does), so that the next trial starts as a fresh process
        does, not beside a mask a larger trial left; and put an LR scheduler in ``restore`` back
        to its step, so the trials' steps do not add up: a ``OneCycleLR`` three steps short of its
        ``total_steps`` raised "Tried to step 11 times" from the probe's fourth trial."""
        if self.model is not None:
            put_back_layout(self.model, self._layout, self.tensors)
        put_back_requires_grad(all_params(self.model, self.extra), self.requires_grad)
        self.attributes.put_back()
        for other, state in self.others:
            if isinstance(other, SCHEDULERS):
                other.load_state_dict(host_copy(state))

    def _unguard(self, keep: bool) -> None:
        if self._guard is not None and not keep:
            self._guard.remove()
            self._guard = None
            self._stepping.remove()

    def _restore_model(self) -> None:
        """Parameters (their ``requires_grad`` too), buffers, gradients and training flags; first the module tree as it was
        (:func:`put_back_layout`: a buffer forward registered is dropped, one it cleared is back)."""
        with torch.no_grad():
            if self.model is not None:
                put_back_layout(self.model, self._layout, self.tensors)
            state = [*(_named_state(self.model) if self.model is not None else ()), *self.extra.items()]
            for name, tensor in state:
                if name not in self.tensors and (self.weights_in_place or self._copy_failed):
                    continue  # a step at learning rate 0 left it, or its copy failed before a step could
                saved, target = self.tensors[name], local(tensor)
                if is_dtensor(tensor) or (target.shape == saved.shape and target.dtype == saved.dtype):
                    target.copy_(saved)  # a DTensor: into this rank's shard
                else:  # forward made it again at another size (a rotary cache): the saved one goes back
                    self._put_back(name, tensor, saved.to(target.device, copy=True))
            put_back_requires_grad(all_params(self.model, self.extra), self.requires_grad)
            for name, param in all_params(self.model, self.extra):
                saved = self.grads.get(name)
                if saved is None:
                    param.grad = None
                else:
                    param.grad = from_cpu_local(saved) if isinstance(saved, Shard) else saved.to(param.device, copy=True)
            if self.model is not None:
                for name, module in self.model.named_modules():
                    module.training = self.training.get(name, module.training)

    def _put_back(self, name: str, tensor: torch.Tensor, fresh: torch.Tensor) -> None:
        """``fresh`` in place of a tensor whose shape or dtype changed: a parameter keeps its
        object (the optimizer holds it), a buffer is replaced in its module."""
        if isinstance(tensor, torch.nn.Parameter) or name in self.extra:
            tensor.data = fresh
        else:
            owner, _, leaf = name.rpartition(".")
            self.model.get_submodule(owner)._buffers[leaf] = fresh

    def _restore_optimizer(self, keep: bool) -> None:
        if self.optimizer is not None and self.optimizer_state is not None:
            # load_state_dict replaces the whole state, so state created during the trials
            # (Adam moments that did not exist before) disappears again; it casts tensors
            # back to each parameter's device; sharded state becomes DTensors laid out as before.
            load_keeping_groups(self.optimizer, from_cpu_local(self.optimizer_state))
            if keep and self.weights_in_place:
                _zero_lrs(self.optimizer)  # load_state_dict put the learning rates back

    def _restore_others(self) -> None:
        """Load each further object's state dict back (a scheduler the probe's steps advanced);
        a ``GradScaler`` also forgets a failed trial's ``unscale_`` of the optimizer."""
        errors: list[BaseException] = []
        for other, state in self.others:
            attempt(lambda: load_other(other, host_copy(state), self.optimizer), errors)
        if errors:
            raise errors[0]

    def _recount(self) -> None:
        """Make again as device memory what an active simulated budget counted at take and the
        restore made as host memory (gradients, a buffer put back, optimizer state), so the
        budget counts what it did before the probe: no more (the copies), and no less."""
        if not self._counted:
            return
        params = dict(all_params(self.model, self.extra))
        held = [p for group in self.optimizer.param_groups for p in group["params"]] if self.optimizer else []
        for place, tensor in list(places(self.model, self.optimizer, self.extra)):
            if place not in self._counted or simulated_counts(tensor):
                continue
            if place[0] == "grad":
                params[place[1]].grad = tensor.clone()
            elif place[0] == "buffer":
                self._put_back(place[1], tensor, tensor.clone())
            else:
                self.optimizer.state[held[place[1]]][place[2]] = tensor.clone()

    def _warn_unrestored(self) -> None:
        """Say so where the step wrote a parameter the optimizer does not hold and nothing copied
        (an EMA teacher updated in the loss, a frozen weight clamped): the probe could not put it
        back. Which ones it cannot tell beforehand: a frozen backbone looks the same, and copying
        every frozen weight would cost a LoRA probe seconds."""
        if self.model is None or not self._versions:
            return
        inside = {} if self._stepping is None else self._stepping.bumps
        written = [name for name, param in self.model.named_parameters()
                   if name in self._versions and name not in self.tensors
                   and param._version - self._versions[name] != inside.get(id(param), 0)]
        if written:
            shown = ", ".join(written[:5]) + (f" and {len(written) - 5} more" if len(written) > 5 else "")
            warnings.warn(
                f"the probe's trials wrote {shown} outside optimizer.step() (in forward or the loss), and the probe "
                "did not copy them, so they keep the trials' changes; probe a TrainStep that does not write weights "
                "(update an EMA teacher after the step), or save and reload them around the probe",
                RuntimeWarning, stacklevel=3,
            )


def _named_state(model: torch.nn.Module, *, parameters: bool = True):
    if parameters:
        yield from model.named_parameters()
    yield from ((name, buf) for name, buf in model.named_buffers() if buf is not None)
