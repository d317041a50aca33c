"""The fake world a step is traced in: fake copies of the model's tensors and optimizer.

:class:`FakeWorld` swaps a :class:`~autobatch.TrainStep`'s parameters, buffers and
optimizer state for fake tensors (one fake per real tensor, so tied weights stay tied) for
the duration of a trace, and puts the real ones back; the user's model and optimizer are
never written to. The model's modules (and those of a loss that is a module, whose parameters
the optimizer may train too) are snapshotted first and restored exactly afterwards: a tensor a
module caches in forward, a buffer or submodule it registers, a hook's list of outputs are
undone; so is what else the step reaches (a helper object the model holds, a dict in a closure
or a global, a rebound global) and an ``lru_cache`` the code calls that computed with fakes is
cleared (:mod:`~autobatch.probe.tracing.trace_state`). :meth:`FakeWorld.leftover` finds a fake tensor
still reachable from the step (kept where nothing puts it back) so the estimate can refuse
instead of leaving the model to train on it. :func:`resident_bytes` is what the real tensors already hold on the
device. Used by :mod:`autobatch.probe.tracing.estimate`.
"""

from __future__ import annotations

import logging
import types
import weakref
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from ...memory.accounting import _COMPONENTS
from .trace_failures import GROUPED_MM, check_operands, check_sparse, grouped_mm
from .trace_optimizer import fake_optimizer
from .trace_state import SEARCH_BUDGET, SEARCH_ITEMS, OutsideState, class_members, find_fake, restore, snapshot
from ..train_step import TrainStep

__all__ = ["FakeWorld", "TraceScaler", "KernelDtypes", "quiet_meta_errors", "unvalidated_distributions", "resident_bytes",
           "loss_module", "trace_steps", "SEARCH_BUDGET", "SEARCH_ITEMS"]

_HALF = (torch.bfloat16, torch.float16)
#: Operators whose real kernel (ATen's, measured on the CPU) returns its result in a larger storage
#: than the result's size, which the fake versions allocate: the elements that storage holds. Losses
#: reduced to a mean or sum compute the unreduced loss (input and target broadcast) into a buffer and
#: reduce into it, so the 0-dim loss keeps it alive until backward; ``col2im`` (``F.fold``, and
#: ``F.unfold``'s backward) allocates its output like its input, the columns, and shrinks it.
_REAL_STORAGE = {
    **dict.fromkeys((torch.ops.aten.mse_loss.default, torch.ops.aten.smooth_l1_loss.default,
                     torch.ops.aten.binary_cross_entropy.default, torch.ops.aten.soft_margin_loss.default),
                    lambda args: torch.broadcast_shapes(args[0].shape, args[1].shape).numel()),
    torch.ops.aten.col2im.default: lambda args: args[0].numel(),
}


@contextmanager
def quiet_meta_errors() -> Iterator[None]:
    """Silence PyTorch's fake-tensor logger for a trace: where an operator's meta kernel raises
    (a shape error the real step raises too), it logs the whole traceback at ERROR level
    before raising it, and the estimate raises that very error (the step's own, with a note:
    :func:`~autobatch.probe.tracing.trace_failures.step_error`), or its
    :class:`~autobatch.probe.tracing.estimate.EstimateError` from it (``auto``: a note, then the trials,
    whose own error the user sees). A user saw 20 lines of "failed while attempting to run meta"
    ahead of their model's real error."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextmanager
def unvalidated_distributions() -> Iterator[None]:
    """Switch off ``torch.distributions``' default argument validation for a trace, and put the
    switch back after. A ``Distribution`` checks its parameters' values when it is built (``if not
    valid.all()`` in ``Distribution.__init__``, on by default), which a fake tensor cannot answer: a
    VAE sampling through ``Normal(mu, sigma).rsample()`` was refused. A fake value has nothing to
    validate; the trials, and training, still check the real values. A distribution built with
    ``validate_args=True`` still validates, and the estimate is refused at that line."""
    distribution = torch.distributions.Distribution
    validating = distribution._validate_args
    distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        distribution.set_default_validate_args(validating)


class KernelDtypes(TorchDispatchMode):
    """Gives fake outputs the dtypes the real kernels allocate, where PyTorch's fake (meta or
    decomposed) version of a normalisation returns others. Entered between the fake mode and
    the accountant, so the accountant counts what the kernel would allocate. It also raises the
    real kernels' error where a matrix product's fake kernel takes matrices of two dtypes
    (:func:`~autobatch.probe.tracing.trace_failures.check_operands`).

    ``native_group_norm_backward`` of a half input with float32 weights (autocast) is
    decomposed in float32 and returns a float32 input gradient, which autograd then casts: two
    allocations (3x the real one) where the kernel allocates one in the input's dtype; a
    GroupNorm network in bf16 was estimated 16-20 % above its measured peak. The statistics
    (``mean``/``rstd``) of a half input with float32 weights are float32 in the real kernels
    (GroupNorm's on every device, LayerNorm's on the CPU) and half in the fake ones: a
    per-token LayerNorm was counted short (0.5-1 % of a small transformer's peak).
    ``native_layer_norm_backward`` returns a contiguous input gradient from the real kernels and,
    from the fake (decomposed) one, one with the strides of the output's gradient: transposed
    where the output is pooled through a transpose (Swin's last LayerNorm), so the next ``view``
    (a Linear's backward) copied it in the trace only (a small Swin was estimated 1.2-1.4 % high).

    Where the real kernel returns its result in a larger storage (:data:`_REAL_STORAGE`: an MSE,
    smooth-L1, BCE or soft-margin loss reduced to a mean or sum keeps its unreduced buffer,
    ``col2im`` the size of its columns), the fake result's storage is grown to it. Uncounted, an
    autoencoder's MSE was estimated 31 % above the batch ``binary`` found, and a recommender
    regressing one score per sample 0.4 %.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        check_operands(func, args)  # the real kernel's dtype check, which the fake one lacks
        out = grouped_mm(args, kwargs or {}) if func is GROUPED_MM else func(*args, **(kwargs or {}))
        check_sparse(func, out)  # a sparse result's size, which a fake one does not have
        if func is torch.ops.aten.native_group_norm_backward.default and out[0] is not None:
            if out[0].dtype != args[1].dtype:
                out = (out[0].to(args[1].dtype), *out[1:])
        elif func is torch.ops.aten.native_layer_norm_backward.default and out[0] is not None:
            if not out[0].is_contiguous():  # the kernels write it contiguous, the decomposition with grad's strides
                out = (out[0].contiguous(), *out[1:])
        elif func in (torch.ops.aten.native_group_norm.default, torch.ops.aten.native_layer_norm.default):
            x, params = args[0], [t for t in args[2:4] if isinstance(t, torch.Tensor)]
            mixed = x.dtype in _HALF and any(t.dtype == torch.float32 for t in params)
            per_device = func is torch.ops.aten.native_group_norm.default or x.device.type == "cpu"
            if mixed and per_device and out[1].dtype != torch.float32:
                out = (out[0], out[1].float(), out[2].float())
        elif func in _REAL_STORAGE:
            nbytes = _REAL_STORAGE[func](args) * out.element_size()
            if out.untyped_storage().nbytes() < nbytes:
                out.untyped_storage().resize_(nbytes)
        return out


class TraceScaler:
    """Stands in for a ``GradScaler`` while tracing: same memory (a scaled loss, in-place
    unscaling of gradients allocates nothing), but no ``.item()`` on fake tensors."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * 65536.0

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """In place, as the real one (before gradient clipping): no allocation beyond a flag."""
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.grad.mul_(1 / 65536.0)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def update(self) -> None:
        pass


def _tensors_of(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_of(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_of(item)


def loss_module(step: TrainStep) -> torch.nn.Module | None:
    """The module the loss is (or whose method it is), other than the model: the parameters it
    holds (a learnable margin head, uncertainty weights) may train with the model's."""
    owner = step.loss_fn.__self__ if isinstance(step.loss_fn, types.MethodType) else step.loss_fn
    return owner if isinstance(owner, torch.nn.Module) and owner is not step.model else None


def _owned_modules(step: TrainStep) -> list[torch.nn.Module]:
    """Every module of the model and of the loss module, each once."""
    modules = {id(m): m for m in step.model.modules()}
    loss = loss_module(step)
    for module in loss.modules() if loss is not None else ():
        modules.setdefault(id(module), module)
    return list(modules.values())


def resident_bytes(step: TrainStep, device: torch.device, round_to: int) -> int:
    """Bytes of the distinct storages of parameters, buffers (the model's and the loss
    module's) and optimizer state on ``device``."""
    seen: dict[int, int] = {}
    tensors = [t for m in _owned_modules(step) for t in (*m._parameters.values(), *m._buffers.values())]
    tensors += list(_tensors_of(list(step.optimizer.state.values())))
    for tensor in tensors:
        if tensor is None or tensor.device.type != device.type:
            continue
        storage = tensor.untyped_storage()
        seen[storage._cdata] = -(-storage.nbytes() // round_to) * round_to
    return sum(seen.values())


def _hooks(modules: list[torch.nn.Module]) -> list[Any]:
    """The hooks that run in the step: each module's (forward, pre-forward, backward), each parameter's
    gradient hooks and the global module hooks. The globals their code reads are put back and checked as
    ``loss_fn``'s are: a module-level ``features = {}`` a forward hook filled kept the trace's fake tensors."""
    glob = torch.nn.modules.module
    found = [*glob._global_forward_pre_hooks.values(), *glob._global_forward_hooks.values(),
             *glob._global_backward_pre_hooks.values(), *glob._global_backward_hooks.values()]
    for module in modules:
        for kind in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks"):
            found += list((getattr(module, kind, None) or {}).values())
        found += [hook for p in module._parameters.values() if p is not None for hook in (p._backward_hooks or {}).values()]
    return found


class FakeWorld:
    """Fake copies of a step's model state and optimizer, swapped in while tracing.

    ``device`` and ``round_to`` are those of the estimate: :meth:`counts` is the accountant's
    choice of the tensors whose storages a trace allocates, and ``existing_bytes`` what the
    step reads on the device that existed before it and is not the model's (a preloaded
    dataset it slices: resident, as the model is).
    """

    def __init__(self, step: TrainStep, mode: FakeTensorMode, device: torch.device, round_to: int = 1) -> None:
        self.step = step
        self.mode = mode
        self.device_type = device.type
        self.round_to = round_to
        self.memo: dict[int, torch.Tensor] = {}
        self.modules = _owned_modules(step)
        self.saved: list[tuple[Any, type, dict[str, Any], dict[str, Any]]] = []
        self.outside: OutsideState | None = None
        self.globals: dict[str, Any] = {}
        self.grads: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        #: fake storage keys of real tensors the trace read -> the fake (kept alive, so the mode
        #: reuses it and its storage key stays the same); and -> the real tensor and its bytes
        self.existing: dict[int, torch.Tensor] = {}
        self.sources: dict[int, tuple[weakref.ref, int]] = {}

    def fake(self, tensor: torch.Tensor, keep_value: bool = False) -> torch.Tensor:
        """The one fake of ``tensor``, with the gradient hooks registered on it (a per-parameter
        clamp allocates as much as the gradient). With ``keep_value`` (a 0-dim tensor that
        needs no gradient) the fake is made from its number and keeps it, so code may read it
        (``BatchNorm(momentum=None)`` divides by ``float(num_batches_tracked)``)."""
        key = id(tensor)
        if key not in self.memo:
            if keep_value and tensor.dim() == 0 and not tensor.requires_grad:
                number = tensor.item()
                with self.mode:
                    fake = torch.tensor(number, dtype=tensor.dtype, device=tensor.device)
            else:
                fake = self.mode.from_tensor(tensor)
            for hook in (tensor._backward_hooks or {}).values():
                fake.register_hook(hook)
            self.memo[key] = self.existing[fake.untyped_storage()._cdata] = fake
        return self.memo[key]

    def refusal(self) -> str | None:
        """Why the real parameters cannot all be swapped for fakes, or None: one the optimizer
        trains that neither the model nor the loss module holds (the step would read the real
        one, and its fake gradient would land on it), or one with a post-accumulate-grad hook
        (typically an optimizer stepping the real parameter inside backward), or a TorchScript
        module (its parameters live in C++; each access makes a new Python object)."""
        named = {}
        for prefix, module in (("", self.step.model), ("loss_fn.", loss_module(self.step))):
            for name, sub in module.named_modules() if module is not None else ():
                if isinstance(sub, torch.jit.ScriptModule):  # checked first: its parameters' ids change
                    where = f"submodule {prefix + name!r}" if name else ("the loss module" if prefix else "the model")
                    return (f"{where} is a TorchScript module (torch.jit.script or trace), "
                            "whose parameters TorchScript holds, so the trace cannot swap them for fake tensors; "
                            "estimate the module before scripting it")
            for name, param in module.named_parameters() if module is not None else ():
                named.setdefault(id(param), prefix + name)
        for g, group in enumerate(self.step.optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                if id(param) not in named:
                    return (
                        f"the optimizer trains param_groups[{g}]['params'][{i}] (shape {tuple(param.shape)}), which "
                        "neither the model nor the loss module holds, so the trace cannot swap it for a fake tensor; "
                        "make it a parameter of the model, or pass the module holding it as loss_fn"
                    )
        for module in self.modules:
            for param in module._parameters.values():
                if isinstance(param, torch.nn.parameter.UninitializedParameter):
                    return (f"parameter {named.get(id(param), '?')} is not initialised yet (a lazy module): run "
                            "one forward pass first")
                if param is not None and getattr(param, "_post_accumulate_grad_hooks", None):
                    return (
                        f"parameter {named.get(id(param), '?')} has a post-accumulate-grad hook, which would run "
                        "on its fake copy (an optimizer stepped in backward would step the real one)"
                    )
        return None

    def swap_in(self) -> None:
        """Snapshot every module (its attributes and the contents of its dicts, lists and
        sets), what else the step reaches (:class:`~autobatch.probe.tracing.trace_state.OutsideState`)
        and the parameters' gradients, then swap parameters and buffers for fakes."""
        members = class_members({type(module) for module in self.modules})
        self.outside = OutsideState({**self._roots(), **members}, [*members.values(), *_hooks(self.modules),
                                    self.step.loss_fn, self.step.make_batch], skip=self.modules,
                                    classes={type(module) for module in self.modules})
        self.globals = {**members, **self.outside.globals}
        self.saved = [snapshot(module) for module in self.modules]
        params = {id(p): p for m in self.modules for p in m.parameters()}
        params.update((id(p), p) for group in self.step.optimizer.param_groups for p in group["params"])
        self.grads = [(param, param._grad) for param in params.values()]
        for module in self.modules:
            for slots in (module._parameters, module._buffers):
                for name, tensor in list(slots.items()):
                    if tensor is not None:
                        slots[name] = self.fake(tensor, keep_value=slots is module._buffers)

    def swap_out(self) -> None:
        """Put every module back as :meth:`swap_in` found it, what else the step reaches (an
        ``lru_cache`` that computed with fakes is cleared), and the gradients."""
        for saved in reversed(self.saved):
            restore(*saved)
        if self.outside is not None:
            self.outside.put_back()
        for param, grad in self.grads:
            if param._grad is not grad:
                param.grad = grad
        self.saved, self.grads, self.outside = [], [], None

    def _roots(self) -> dict[str, Any]:
        """Where the step's state is reached from: its model, loss, batch maker and optimizer."""
        return {"model": self.step.model, "loss_fn": self.step.loss_fn, "make_batch": self.step.make_batch,
                "optimizer": self.step.optimizer}

    def counts(self, tensor: torch.Tensor) -> bool:
        """Whether the accountant counts ``tensor``'s storage: a fake on the device that the
        trace made, not the fake copy of a tensor that existed before it (a slice of it is a
        view, which allocates nothing, as :func:`~autobatch.simulated_memory` sees it)."""
        if tensor.device.type != self.device_type:
            return False
        if tensor.layout in _COMPONENTS:  # a sparse tensor: by its index and value tensors
            parts = [getattr(tensor, name)() for name in _COMPONENTS[tensor.layout]]
            return any([self.counts(part) for part in parts])  # each real part registered as existing
        if isinstance(tensor, FakeTensor):
            return tensor.untyped_storage()._cdata not in self.existing
        fake = self.mode.from_tensor(tensor)  # what the mode will use for it: memoised
        key = fake.untyped_storage()._cdata
        if key not in self.existing:
            self.existing[key] = fake
            nbytes = -(-tensor.untyped_storage().nbytes() // self.round_to) * self.round_to
            self.sources[key] = (weakref.ref(tensor), nbytes)
        return False

    @property
    def existing_bytes(self) -> int:
        """Bytes of the real tensors the trace read that are still alive after it: data that
        existed before it (a real tensor ``torch.tensor(0.0)`` makes mid-step dies at once)."""
        return sum(nbytes for ref, nbytes in self.sources.values() if ref() is not None)

    def leftover(self) -> str | None:
        """Where a fake tensor of this trace is still reachable from the step after
        :meth:`swap_out` (its model, loss, batch maker, optimizer, their gradients and the
        globals their code reads), or None."""
        return find_fake({**self._roots(), **self.globals},
                         lambda t: isinstance(t, FakeTensor) and t.fake_mode is self.mode)

    def optimizer(self) -> torch.optim.Optimizer:
        """A copy of the optimizer (and of one it wraps) over the fake parameters, with fake state
        (:func:`~autobatch.probe.tracing.trace_optimizer.fake_optimizer`)."""
        return fake_optimizer(self.step.optimizer, self.fake, self._scalar)

    def _scalar(self, value: torch.Tensor) -> torch.Tensor:
        """A fake of a 0-dim tensor made from its number, so the optimizer can read it."""
        number = value.item()
        with self.mode:
            return torch.tensor(number, dtype=value.dtype, device=value.device)


#: At most this many steps beyond the ``steps`` asked for are traced while each leaves more memory
#: held than it found (:func:`trace_steps`).
LATE_STEPS = 2


def trace_steps(fake_step: TrainStep, batch_size: int, steps: int, accountant: Any) -> int:
    """Trace ``steps`` steps, then (``steps`` of 2 or more) up to :data:`LATE_STEPS` more while the
    last one left more memory held than it found: state it made (an optimizer whose buffers appear
    on its second step) is first under activations in the next step's peak, as in a trial's third
    step, which the default ``steps_per_trial`` runs. A step that keeps growing what it holds (a
    leak) stops there. ``steps=1`` traces a first step only.

    Returns the bytes the last step still added to what is held where every step traced did (a
    leak: outputs appended to a list; lazily made state stops growing by then), else 0: the peak
    of a step that grows depends on how many steps ran, so the estimate says so
    (:attr:`~autobatch.probe.tracing.estimate_records.MemoryEstimate.held_growth_bytes`)."""
    most = steps + (LATE_STEPS if steps >= 2 else 0)
    traced, grew = 0, 0
    while traced < steps or (grew and traced < most):
        held = accountant.current_bytes
        fake_step(batch_size)
        traced += 1
        grew = max(0, accountant.current_bytes - held)
    return grew if steps >= 2 and traced == most else 0
