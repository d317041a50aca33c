"""A probe's unit of work built from a model: one real training step at a given batch size."""

from __future__ import annotations

import inspect
import types
from contextlib import nullcontext
from typing import Any, Callable, Mapping

import torch

from .. import checks
from ..errors import add_note
from ..memory.oom import is_oom_error
from .snapshot.restore import forget_scaler_stage
from .snapshot.ddp_reducer import reset_failed_reduction
from .snapshot.shards import check_optimizer_after_sharding

__all__ = ["TrainStep", "AUTOCAST_DTYPES", "check_loop_inputs", "autocast_context", "autocast_factory"]

#: The dtypes ``autocast_dtype`` takes: the half types autocast runs in, and float32 (autocast's
#: no-op on the CPU). An integer type, which ``torch.autocast`` would take without a word, is refused.
AUTOCAST_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class TrainStep:
    """``fn(batch_size)`` that runs forward, backward and an optimizer step on a fresh batch.

    ``make_batch(B)`` builds a batch of ``B`` samples on the model's device (a tensor, or any
    structure of tensors); ``loss_fn(model, batch)`` returns a scalar loss tensor (or a dict or
    model output holding it as ``"loss"``, as a Transformers model given labels returns: the
    loss is taken and the rest dropped before backward, as the Transformers ``Trainer`` does;
    anything else is refused with what to return, and so is a loss that is a fake tensor left
    by a trace, :class:`~autobatch.errors.FakeTensorLeakError`). The optimizer's ``step()``
    must run without a closure (not ``LBFGS``). Because a trial
    really trains, :func:`~autobatch.find_max_batch` snapshots the model and optimizer before
    probing and restores them afterwards whenever it is given a ``TrainStep``.

    ``autocast_dtype`` (``torch.bfloat16`` / ``torch.float16`` / ``torch.float32``, or its name,
    ``"bfloat16"``) runs forward and loss under ``torch.autocast`` (float32 on the CPU, whose
    autocast takes only the half types, runs without it); ``grad_scaler`` (a
    ``torch.amp.GradScaler``) scales the loss for fp16. Any other value is refused at once.
    ``max_grad_norm`` clips the gradients' total norm before every optimizer step
    (``torch.nn.utils.clip_grad_norm_``; with a grad scaler, after unscaling them), so a probe
    measures the step training runs. The step keeps no reference to the batch, the loss or the
    graph once it returns.
    """

    @checks.keywords({"loss": "loss_fn", "criterion": "loss_fn", "batch_fn": "make_batch", "collate_fn": "make_batch",
                      "dtype": "autocast_dtype", "precision": "autocast_dtype", "scaler": "grad_scaler",
                      "clip_grad_norm": "max_grad_norm", "gradient_clip_val": "max_grad_norm"})
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
        make_batch: Callable[[int], Any] | None,
        *,
        autocast_dtype: torch.dtype | str | None = None,
        grad_scaler: "torch.amp.GradScaler | None" = None,
        max_grad_norm: float | None = None,
    ) -> None:
        checks.module("model", model)
        checks.materialized("model", model)
        refuse_several(optimizer, "a TrainStep")  # a GAN's (opt_g, opt_d): printed whole, with no word of what to do
        checks.optimizer("optimizer", optimizer)
        check_optimizer_after_sharding(model, optimizer)  # built before fully_shard: the sharded ones would not train
        checks.trains("optimizer", optimizer, model)
        checks.no_closure("optimizer", optimizer)  # LBFGS: its step needs a closure, which no step here passes
        checks.function("loss_fn", loss_fn, "loss_fn(model, batch) -> mean loss tensor")
        if make_batch is not None:  # None: a step that only trains on batches it is given
            checks.function("make_batch", make_batch, "make_batch(batch_size) -> batch")
        _check_arguments(loss_fn, make_batch)
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.make_batch = make_batch
        self.autocast_dtype = checks.dtype("autocast_dtype", autocast_dtype, allowed=AUTOCAST_DTYPES)
        self.grad_scaler = checks.grad_scaler("grad_scaler", grad_scaler)
        _check_scaled_dtypes(optimizer, self.grad_scaler, model)
        self.max_grad_norm = checks.positive_number("max_grad_norm", max_grad_norm, allow_none=True)
        self.optimizer_ooms = set()

    def options(self) -> dict[str, Any]:
        """The keyword options, to build another ``TrainStep`` that steps the same way (the
        distributed wrappers, the runner's planning step)."""
        return {"autocast_dtype": self.autocast_dtype, "grad_scaler": self.grad_scaler, "max_grad_norm": self.max_grad_norm}

    @property
    def device(self) -> torch.device:
        """The device of the model's first parameter (the CPU for a parameterless model)."""
        for tensor in self.model.parameters():
            return tensor.device
        return torch.device("cpu")

    def autocast(self):
        """The autocast context of this step (a no-op without ``autocast_dtype``)."""
        return autocast_context(self.autocast_dtype, self.device)

    def __call__(self, batch_size: int) -> None:
        batch_size = checks.positive_int("batch_size", batch_size)  # 0 trained a step on an empty batch
        if self.make_batch is None:  # was "'NoneType' object is not callable"
            raise TypeError("this TrainStep was built with make_batch=None, so it trains only on batches it is given: "
                            "pass make_batch(batch_size) -> batch to TrainStep to call or probe it with a batch size")
        self.begin()
        batch = self.make_batch(batch_size)
        with self.autocast():
            loss = checks.loss("loss_fn", self.loss_fn(self.model, batch))  # a model output's .loss; the rest dropped
        del batch  # backward needs what autograd saved, not the inputs: as the runner's step
        (self.grad_scaler.scale(loss) if self.grad_scaler is not None else loss).backward()
        self.gradless = gradless(self.optimizer)
        self.optimizer_ooms.discard(batch_size)
        try:
            self.optimizer_step()
        except BaseException as exc:  # re-raised: only noted where it is an OOM
            if is_oom_error(exc):
                self.optimizer_ooms.add(batch_size)
            raise
        self.optimizer.zero_grad(set_to_none=True)

    #: the batch sizes whose last step ran out of memory inside ``optimizer.step()`` (after backward), which
    #: no smaller batch shrinks: a plan that failed there names the optimizer (:func:`~.foreach.foreach_note`)
    optimizer_ooms: set[int]

    #: ``(without, trainable)``: of the parameters the optimizer trains that require grad, how many the last
    #: step's backward gave no gradient (:func:`gradless`; None before a step)
    gradless: tuple[int, int] | None = None

    #: with ``max_grad_norm``: the last step's gradient norm before clipping, a 0-dim tensor not read (no device
    #: sync), dropped when the next step begins; the runner's ``on_step_end`` reads it as ``info["grad_norm"]``
    grad_norm: torch.Tensor | None = None

    def begin(self) -> None:
        """Start a step: zero the optimizer's gradients and, with an enabled grad scaler, forget
        the mark (and inf check) of an ``unscale_`` that a failed call left, whose gradients are
        gone. Before, a call after one that ran out of memory inside ``optimizer.step()`` raised
        torch's "unscale_() has already been called" with ``max_grad_norm``, and without it stepped
        the new gradients still scaled (SGD at lr 1e-2: weights of 0.4 became 42 to 133) on the old ones' inf check."""
        self.optimizer.zero_grad(set_to_none=True)
        self.grad_norm = None
        if isinstance(self.grad_scaler, torch.amp.GradScaler):  # not the estimate's TraceScaler, which keeps no marks
            forget_scaler_stage(self.grad_scaler, self.optimizer)

    def optimizer_step(self) -> None:
        """Clip the gradients' norm (``max_grad_norm``), then step the optimizer, through the
        grad scaler when there is one (fp16)."""
        try:
            self._clip_and_step()
        except ValueError as error:  # the model was cast to float16 after the step was built
            if self.grad_scaler is not None and "unscale FP16 gradients" in str(error):
                add_note(error, _fp16_scaler_advice(self.optimizer, self.model))
            raise

    def _clip_and_step(self) -> None:
        """:meth:`optimizer_step`'s work."""
        if self.max_grad_norm is not None:
            if self.grad_scaler is not None:
                self.grad_scaler.unscale_(self.optimizer)  # clip true gradients; step() will not unscale again
            self.grad_norm = clip_grad_norm([p for group in self.optimizer.param_groups for p in group["params"]],
                                            self.max_grad_norm)
        if self.grad_scaler is not None:
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()
        else:
            self.optimizer.step()

    def clear_grads(self) -> None:
        """Drop gradients left behind by a step that failed part-way (and, with a grad
        scaler, its mark that this step's gradients were already unscaled)."""
        self.optimizer.zero_grad(set_to_none=True)
        for param in self.model.parameters():
            param.grad = None
        reset_failed_reduction(self.model)
        if self.grad_scaler is not None and self.grad_scaler.is_enabled():
            forget_scaler_stage(self.grad_scaler, self.optimizer)

    def __repr__(self) -> str:
        return f"TrainStep(model={type(self.model).__name__}, optimizer={type(self.optimizer).__name__})"


def autocast_context(dtype: torch.dtype | None, device: torch.device):
    """``torch.autocast`` of ``dtype`` on ``device``'s type; a no-op for None, and for float32 on the
    CPU, whose autocast takes only the half types (it would switch itself off, with a warning)."""
    if dtype is None or (dtype is torch.float32 and device.type == "cpu"):
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def autocast_factory(name: str, value: Any, model: torch.nn.Module) -> Callable[[], Any] | None:
    """The accumulation loop's ``autocast`` (:func:`~autobatch.accumulate_gradients`) as the factory it
    calls per micro-batch: a factory as it is (``TrainStep.autocast``, ``lambda: torch.autocast(...)``);
    a ``torch.autocast(...)`` object, entered once per micro-batch (as its decorator form is); a dtype
    or its name, as ``TrainStep(autocast_dtype=)`` takes it, on the model's device. Before, a dtype or
    name failed as "'torch.dtype' object is not callable" and an autocast object as "missing 1 required
    positional argument: 'func'", from the first micro-batch; anything else is one ``TypeError``."""
    if isinstance(value, torch.autocast):
        return lambda: value
    if value is None or callable(value):
        return value
    if not isinstance(value, (str, torch.dtype)):
        raise TypeError(f"{name} must be a dtype (torch.float16, 'bfloat16'), a torch.autocast(...) or a function "
                        f"returning a context (a TrainStep's .autocast), got {type(value).__name__} {checks.shown(value)}")
    dtype = checks.dtype(name, value, allowed=AUTOCAST_DTYPES)
    device = next((tensor.device for tensor in model.parameters()), torch.device("cpu"))
    return lambda: autocast_context(dtype, device)


def _fp16_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The float16 parameters ``optimizer`` trains (their gradients are float16 too)."""
    return [p for group in optimizer.param_groups for p in group["params"]
            if p.requires_grad and p.dtype == torch.float16]


def _fp16_scaler_advice(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> str:
    """What to change where a grad scaler meets float16 parameters: torch's own error, "Attempting
    to unscale FP16 gradients.", names neither the parameters nor the fix."""
    held = _fp16_parameters(optimizer)
    names = {id(p): name for name, p in model.named_parameters()}
    first = next((names[id(p)] for p in held if id(p) in names), None)
    where = f" (the first: {first!r})" if first else ""
    return (f"grad_scaler cannot unscale float16 gradients, and the optimizer trains {len(held)} float16 "
            f"parameter(s){where}: torch's GradScaler unscales float32 gradients only. For fp16 mixed precision keep "
            "the model in float32 (drop model.half() / .to(torch.float16)) and pass autocast_dtype=torch.float16; "
            "for a model kept in half precision pass grad_scaler=None, or keep it in torch.bfloat16, which needs no scaler")


def _check_scaled_dtypes(optimizer: torch.optim.Optimizer, scaler: Any, model: torch.nn.Module) -> None:
    """An enabled grad scaler with an optimizer training float16 parameters is refused when the
    step is built: every step would raise torch's bare "Attempting to unscale FP16 gradients."
    (the first trial of a probe, the first step of a run). A disabled scaler unscales nothing."""
    if scaler is not None and scaler.is_enabled() and _fp16_parameters(optimizer):
        raise ValueError(_fp16_scaler_advice(optimizer, model))


def _takes(fn: Callable[..., Any], count: int) -> bool | None:
    """Whether ``fn`` can be called with ``count`` positional arguments (None: its signature
    cannot be read, as for some builtins)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*range(count))
    except TypeError:
        return False
    return True


def _check_arguments(loss_fn: Callable[..., Any], make_batch: Callable[[int], Any] | None) -> None:
    """``loss_fn`` takes ``(model, batch)`` and ``make_batch`` the batch size alone, so that a
    mistake is one error when the step is built, not a bare ``missing 1 required positional
    argument`` from the probe's first trial (or a fake-tensor trace, whose note then said to probe
    with real trials). Swapped (``TrainStep(model, optimizer, make_batch, loss_fn)``) is named so."""
    _refuse_torch_function(loss_fn)
    loss_ok = _takes(loss_fn, 2) is not False
    batch_ok = make_batch is None or _takes(make_batch, 1) is not False
    if loss_ok and batch_ok:
        return
    if make_batch is not None and _takes(loss_fn, 1) and _takes(make_batch, 2):
        raise TypeError("TrainStep(model, optimizer, loss_fn, make_batch) calls loss_fn(model, batch) and "
                        "make_batch(batch_size); the loss_fn given takes one argument and the make_batch two: they look "
                        "swapped. Pass them in that order, or by name (loss_fn=..., make_batch=...)")
    name, fn, wanted = ("loss_fn", loss_fn, "(model, batch)") if not loss_ok else ("make_batch", make_batch, "(batch_size)")
    raise TypeError(f"{name} is called as {name}{wanted}; the {name} given, "
                    f"{getattr(fn, '__qualname__', type(fn).__name__)}{inspect.signature(fn)}, cannot be called so: "
                    f"give it the arguments {wanted}")


def check_loop_inputs(model: Any, loss_fn: Any, call: str) -> None:
    """The checks a :class:`TrainStep` makes of ``model`` and ``loss_fn``, for a ``call`` that builds
    none (``accumulate_gradients``): there ``(loss_fn, model)`` swapped failed as "Sequential.forward()
    takes 2 positional arguments but 3 were given", ``nn.CrossEntropyLoss()`` or ``F.cross_entropy``
    as "argument 'input' must be Tensor, not Linear" and a ``loss_fn(batch)`` as "takes 1 positional
    argument but 2 were given", from inside the first micro-batch."""
    if isinstance(loss_fn, torch.nn.Module) and not isinstance(model, torch.nn.Module):
        raise TypeError(f"{call} takes the model first, then loss_fn(model, batch): got loss_fn={type(loss_fn).__name__} "
                        f"and model={type(model).__name__}, which look swapped; pass them in that order, or by name")
    checks.module("model", model)
    checks.function("loss_fn", loss_fn, "loss_fn(model, batch) -> mean loss tensor")
    _check_arguments(loss_fn, None)


def refuse_several(optimizer: Any, what: str) -> None:
    """A list, tuple or dict of optimizers (one per learning rate, Lightning's ``configure_optimizers``
    list, a GAN's ``(opt_g, opt_d)``) failed as "must be a torch.optim.Optimizer, got list [Adam
    (Parameter Group 0 ..." with each printed whole: one ``TypeError`` saying that ``what`` (a
    TrainStep, the runner) steps one optimizer, and what a step of one loss (param groups) and one of
    several losses each stepping its own optimizer (a GAN) do instead (:func:`several_optimizers_advice`)."""
    several = list(optimizer.values()) if isinstance(optimizer, Mapping) else optimizer  # {"g": opt_g, "d": opt_d}
    if isinstance(several, (list, tuple)) and any(isinstance(item, torch.optim.Optimizer) for item in several):
        raise TypeError(f"optimizer must be one torch.optim.Optimizer, got a {type(optimizer).__name__} of {len(several)} "
                        f"({', '.join(type(item).__name__ for item in several)}): {what} steps one optimizer per step. "
                        f"{several_optimizers_advice(several)}")


def several_optimizers_advice(optimizers: list | tuple) -> str:
    """How to make one optimizer of a list. ``SparseAdam`` (for ``sparse=True`` embeddings) takes no dense
    gradient and Adam no sparse one, so param groups of one Adam cannot hold both: name the optimizers that can."""
    if any(isinstance(item, torch.optim.SparseAdam) for item in optimizers):
        return ("SparseAdam takes sparse gradients only, and Adam/AdamW dense ones only, so no param group joins them: "
                "train the whole model with one optimizer that takes both, torch.optim.SGD or torch.optim.Adagrad "
                "(param groups for their own learning rates), or build the embeddings with sparse=False and use one AdamW")
    return ("Give parts their own learning rate with param groups, e.g. torch.optim.AdamW([{'params': "
            "model.encoder.parameters(), 'lr': 1e-4}, {'params': model.head.parameters(), 'lr': 1e-3}]) "
            "(a scheduler takes a list of max_lr per group). A step of several losses, each stepping its own optimizer "
            "(a GAN's generator and discriminator), is no step the Runner, TrainStep or plan() takes: probe it as a "
            "plain callable, find_max_batch(fn, restore=(gen, opt_g, disc, opt_d)), and train it in your own loop at "
            "that batch size (@autobatch.find_executable_batch_size runs the loop again, from its start, at a smaller "
            "one after an OOM)")


def _refuse_torch_function(loss_fn: Callable[..., Any]) -> None:
    """A loss function of torch's own (``F.cross_entropy``) takes ``(input, target)``, never
    ``(model, batch)``: refused when the step is built with the wrapper to write, where the first
    trial raised torch's bare "argument 'input' (position 1) must be Tensor, not Sequential"."""
    module = getattr(loss_fn, "__module__", None) or ""
    if isinstance(loss_fn, (types.FunctionType, types.BuiltinFunctionType)) and (
            module == "torch" or module.startswith("torch.")):
        name = f"{module}.{getattr(loss_fn, '__name__', '?')}"
        raise TypeError(f"loss_fn is called as loss_fn(model, batch); {name} is torch's own function, called on the "
                        "model's output and the target: wrap it, e.g. loss_fn=lambda model, batch: "
                        f"{name}(model(batch[0]), batch[1])")


def clip_grad_norm(parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(parameters, max_norm)``, which takes no sparse gradient (a
    ``sparse=True`` embedding's): every step with ``max_grad_norm`` raised torch's bare "Could not run
    'aten::linalg_vector_norm' with arguments from the 'SparseCPU' backend", in the probe and the runner.
    Where a gradient is sparse, the same norm of the gradients' norms (a sparse one's over its coalesced
    values) and the same clamped scale, ``max_norm / (norm + 1e-6)``, applied to every gradient. Returns
    the total norm before clipping, as torch's does."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not any(grad.is_sparse for grad in grads):
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    norms = [torch.linalg.vector_norm(grad.coalesce().values() if grad.is_sparse else grad) for grad in grads]
    total = torch.linalg.vector_norm(torch.stack([norm.to(grads[0].device) for norm in norms]))
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(scale.to(grad.device))
    return total


def gradless(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """``(without, trainable)``: how many of the parameters ``optimizer`` trains that require grad have no
    gradient after a backward, of how many. Such a parameter makes no optimizer state in the step, so a
    probe's answer leaves its state out: adapters cut off by a reentrant checkpoint whose inputs do not
    require grad (a LoRA model checkpointing blocks after a frozen embedding, with a trainable head, trained
    the head alone, without a word from autobatch), or parameters the loss does not use."""
    trainable = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    return sum(p.grad is None for p in trainable), len(trainable)
