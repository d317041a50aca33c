"""The runner's precision: what a checkpoint records of it, and the warnings about it.

A run's precision is its autocast dtype and whether an *enabled* ``GradScaler`` scales its loss
(``GradScaler(enabled=use_fp16)`` with fp16 off scales nothing: recorded as no scaler, or a
resume into a run without one warned of a scaler that never ran). A resume at another precision
is warned about, saying what it costs: another autocast dtype, a micro-batch sized for the old
one; a scaler dropped, its learned scale and fp16 gradients left unscaled; a scaler added, its
first steps skipped while it backs off from its ``init_scale``. A scaler's settings the
checkpoint replaces (``load_state_dict`` takes its growth interval and factors too) are named,
as the optimizer's are. A runner built to train float16 parameters, or under float16 autocast,
without loss scaling is warned about once, when it is made: its small gradients become zero, and
Adam's ``eps=1e-8`` is 0 in float16 (AdamW at lr 1e-3 on a float16 model: NaN loss from its
second step, in plain PyTorch as in the runner). A checkpoint whose weights are of another
dtype than this run's model (saved from a bfloat16 model, resumed into a float32 one, or the
reverse) loaded with a silent cast, as ``load_state_dict`` copies: now one warning names the
dtypes (and, where this run's is the narrower, that the precision the file holds is rounded off
in this run, the file keeping it), and a cast to float16 that would turn weights above its range
(65504) into inf is refused before anything is loaded.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..errors import CheckpointError

__all__ = ["precision_of", "weights_dtype", "warn_changed_precision", "check_dtypes", "load_grad_scaler", "warn_unscaled_float16"]

log = logging.getLogger("autobatch")

_SCALER_SETTINGS = ("growth_factor", "backoff_factor", "growth_interval")
_FP16_TINY = 2.0**-25  # below it a float rounds to 0 in float16 (half its smallest subnormal, 6e-8)


def scaling(scaler: Any) -> bool:
    """Whether ``scaler`` is a grad scaler that scales (given and enabled)."""
    return scaler is not None and scaler.is_enabled()


def precision_of(step: Any) -> dict[str, Any]:
    """A runner step's precision, as its checkpoint records it: the autocast dtype and whether an
    enabled grad scaler scales the loss (fp16)."""
    dtype = step.autocast_dtype
    return {"autocast": None if dtype is None else str(dtype).removeprefix("torch."),
            "grad_scaler": scaling(step.grad_scaler)}


def weights_dtype(model: torch.nn.Module) -> torch.dtype:
    """The precision ``model``'s parameters are held in, for :func:`warn_changed_precision`: float16
    where any is (its gradients flow in float16), else bfloat16 where any is, else float32."""
    dtypes = {p.dtype for p in model.parameters()}
    return next((dtype for dtype in (torch.float16, torch.bfloat16) if dtype in dtypes), torch.float32)


def warn_changed_precision(state: dict[str, Any], mine: dict[str, Any], *, weights: torch.dtype = torch.float32) -> None:
    """Warn where the checkpoint's run trained at another precision (checkpoints of earlier
    versions do not say), naming what the change costs (module docstring). A scaler dropped
    costs float16 gradients only where this run has them (float16 autocast, or float16
    ``weights``, :func:`weights_dtype`): a run in bfloat16 or float32 needs none, and was told
    its "float16 gradients are not scaled" all the same; one without autocast is named by its
    weights' dtype (a bfloat16 model was told it "trains in float32")."""
    saved = state.get("precision")
    if saved is None or saved == mine:
        return
    if saved["autocast"] != mine["autocast"]:
        log.warning("resume: the checkpoint's run trained with autocast %s and this run with %s: its micro-batch (%s) "
                    "was sized for that precision and may not fit (an OOM steps it down, losing no sample)",
                    saved["autocast"], mine["autocast"], state.get("micro_batch"))
    if saved["grad_scaler"] and not mine["grad_scaler"]:
        scale = (state.get("grad_scaler") or {}).get("scale")
        if mine["autocast"] == "float16" or weights == torch.float16:
            cost = ("float16 gradients are not scaled (small ones become zero); pass grad_scaler=torch.amp.GradScaler("
                    "device) to go on with its scale")
        else:
            trains = mine["autocast"] or f"{_dtype(weights)} (its weights' dtype)"
            cost = f"this run trains in {trains}, not float16, so it needs no loss scaling"
        log.warning("resume: the checkpoint's run scaled its loss with a grad scaler (scale %s) and this run has none "
                    "enabled: its scaler state is not used; %s", scale, cost)
    elif mine["grad_scaler"] and not saved["grad_scaler"]:
        log.warning("resume: the checkpoint's run had no grad scaler and this run has one: it starts from its "
                    "init_scale, not a learned scale, so its first steps may be skipped while it backs off "
                    "(result.skipped_steps)")


def load_grad_scaler(scaler: Any, saved: dict[str, Any] | None) -> None:
    """Load a checkpoint's grad scaler state into this run's enabled ``scaler``; warn where it
    replaces settings this run's scaler was given (``load_state_dict`` takes them, as an
    optimizer's takes its learning rate): set them after resuming to change them."""
    if not scaling(scaler) or not saved:
        return
    mine = scaler.state_dict()
    changed = [f"{name} {saved[name]!r} (this run's {mine[name]!r})" for name in _SCALER_SETTINGS
               if name in saved and saved[name] != mine.get(name)]
    if changed:
        log.warning("resume: the checkpoint's grad scaler settings replace this run's: %s; set them on the scaler "
                    "after resuming to change them", ", ".join(changed))
    scaler.load_state_dict(saved)


def warn_unscaled_float16(optimizer: torch.optim.Optimizer, model: torch.nn.Module, autocast_dtype: torch.dtype | None,
                          scaler: Any, device: torch.device | None = None) -> None:
    """Warn, once when the runner is made, where it trains without loss scaling in float16:
    float16 parameters (no float32 copy; an enabled scaler refuses them already), or float16
    autocast without an enabled grad scaler. Each warning says what to change, naming the
    scaler for ``device``: a ``GradScaler()`` (``"cuda"`` by default) given to a run on the CPU
    is disabled by torch, so the run trains unscaled though the user passed a scaler. An enabled
    scaler where nothing is float16 is warned about too (:func:`_warn_needless_scaler`)."""
    if scaling(scaler):
        _warn_needless_scaler(optimizer, autocast_dtype)
        return
    wanted = f"torch.amp.GradScaler({device.type!r})" if device is not None else "torch.amp.GradScaler(device)"
    held = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad and p.dtype == torch.float16]
    if held:
        names = {id(p): name for name, p in model.named_parameters()}
        first = next((names[id(p)] for p in held if id(p) in names), None)
        eps = sorted({group["eps"] for group in optimizer.param_groups
                      if isinstance(group.get("eps"), float) and 0 < group["eps"] < _FP16_TINY})
        zero_eps = f"; the optimizer's eps={eps[0]:g} is 0 in float16, so a second moment that underflows divides by " \
                   "zero (inf or NaN weights)" if eps else ""
        log.warning("the optimizer trains %d float16 parameter(s)%s with no float32 copy and no loss scaling: "
                    "gradients below float16's range (6e-8) become zero and updates below a weight's resolution are "
                    "lost%s. Keep the model in float32 and pass autocast_dtype='float16' with "
                    "grad_scaler=%s, or hold it in bfloat16 (float32's range, no scaler)",
                    len(held), f" (the first: {first!r})" if first else "", zero_eps, wanted)
    elif autocast_dtype is torch.float16:
        log.warning("autocast_dtype=float16 without an enabled grad_scaler%s: float16 gradients below 6e-8 become zero "
                    "and their updates are lost; pass grad_scaler=%s (it skips the steps whose gradients overflow), "
                    "or autocast_dtype='bfloat16', which needs none", _disabled_by_device(scaler, device), wanted)


def _warn_needless_scaler(optimizer: torch.optim.Optimizer, autocast_dtype: torch.dtype | None) -> None:
    """Warn where an enabled grad scaler scales a run with no float16 in it: bfloat16 autocast, or
    bfloat16 parameters without autocast (the fp16 recipe with its dtype changed to bfloat16). It
    trained without a word, as in plain PyTorch; but bfloat16 has float32's exponent range, so
    nothing underflows for the scaler to save, and ``GradScaler.step`` reads its inf check on the
    host (a device sync every step) and adds a pass over the gradients. Lightning refuses a scaler
    under ``"bf16-mixed"``; here it trains, warned. Float32 without autocast is left alone: a
    ``loss_fn`` may run its own ``torch.autocast(dtype=torch.float16)``."""
    trained = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    bf16_weights = autocast_dtype is None and bool(trained) and all(p.dtype == torch.bfloat16 for p in trained)
    if autocast_dtype is not torch.bfloat16 and not bf16_weights:
        return
    what = "autocast_dtype=bfloat16" if autocast_dtype is torch.bfloat16 else "bfloat16 parameters"
    log.warning("an enabled grad_scaler with %s: bfloat16 has float32's exponent range, so its gradients need no loss "
                "scaling, and the scaler only adds a pass over them and a device sync per step (GradScaler.step reads "
                "its inf check on the host); pass grad_scaler=None, or autocast_dtype='float16' (float32 parameters) "
                "for fp16, which does need it", what)


def _disabled_by_device(scaler: Any, device: torch.device | None) -> str:
    """Why a scaler the user passed scales nothing, where torch disabled it for its device: a
    ``GradScaler()`` is a CUDA one, which turns itself off without CUDA (torch's own warning
    says only "Disabling"), so a run on the CPU copying the CUDA recipe trained fp16 unscaled."""
    own = getattr(scaler, "_device", None)
    if scaler is None or device is None or not isinstance(own, str) or own == device.type:
        return ""
    return (f" (the grad_scaler given is a GradScaler({own!r}), which torch disabled: no {own} here, and this run "
            f"trains on {device.type})")


def check_dtypes(path: Any, model: torch.nn.Module, saved: dict[str, Any]) -> None:
    """Warn, once, where the checkpoint's floating-point weights (``saved``: its model state) are
    of other dtypes than ``model``'s, naming each change, how many tensors and the first; a
    :class:`~autobatch.errors.CheckpointError` where one would overflow float16 (inf weights).
    A change of dtype is a choice (float32 from bfloat16 training, bfloat16 to save memory), so
    not an error: ``load_state_dict`` casts, and the checkpoint file keeps what it held."""
    changes: dict[tuple[torch.dtype, torch.dtype], list[str]] = {}
    for name, mine in model.state_dict().items():
        theirs = saved.get(name)
        if not (isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor) and mine.is_floating_point()
                and theirs.is_floating_point() and mine.dtype != theirs.dtype):
            continue
        if mine.dtype == torch.float16 and theirs.numel() and theirs.abs().max().item() > torch.finfo(torch.float16).max:
            raise CheckpointError(
                path, f"its {name} ({_dtype(theirs.dtype)}) holds values above float16's range (65504), which this "
                "run's float16 model would load as inf; resume with the model in "
                f"{_dtype(theirs.dtype)} (or float32), e.g. model.to(torch.{_dtype(theirs.dtype)}) before Runner(...)")
        changes.setdefault((theirs.dtype, mine.dtype), []).append(name)
    if not changes:
        return
    parts = []
    for (theirs, mine), names in changes.items():
        narrower = torch.finfo(mine).eps > torch.finfo(theirs).eps
        parts.append(f"{len(names)} tensor(s) saved in {_dtype(theirs)} load into this run's {_dtype(mine)} (the first: "
                     f"{names[0]!r}){': rounded, the precision the checkpoint holds is lost in this run' if narrower else ''}")
    log.warning("resume: the checkpoint's weights are of another dtype than this model's: %s; its optimizer state is "
                "cast the same way. The file keeps its own; to go on in its dtype, convert the model (model.to(dtype)) "
                "before Runner(...)", "; ".join(parts))


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
