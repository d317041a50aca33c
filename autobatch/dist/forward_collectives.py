"""Model layouts under ``torch.distributed`` that autobatch cannot drive as given, warned about
once per model at the probe's or the runner's start.

* **Collectives inside forward.** autobatch keeps the ranks in step by entering every collective
  it makes on every rank or on none (:mod:`autobatch.dist.step`). A ``torch.nn.SyncBatchNorm``
  all-gathers its statistics inside the forward, on the process group autobatch votes on: a rank
  that runs out of memory before or inside that forward leaves the others waiting in the
  all-gather, or pairs their gather with its own vote, and neither a probe trial nor the runner's
  replay can recover it (the other ranks wait until the process group's timeout, or fail there).
* **``torch.compile(DDP(model))``.** The runner trains a DDP's local module (or DDP itself, whose
  reducer it drives), never the compiled wrapper around it, so the compilation was silently
  dropped (found training ``model.module`` eagerly, through one all-reduce after backward instead
  of DDP's overlapped buckets).
* **A DDP option the local module cannot keep.** A DDP that the runner trains through its local
  module (:func:`~autobatch.dist.ddp_step.ddp_supported`) all-reduces the gradients once after
  backward, in their own dtype: a communication hook of the user's (``fp16_compress_hook``,
  PowerSGD) and DDP's ``mixed_precision`` were silently not applied (the full-precision
  all-reduce the hook was registered to cut, a forward in the parameters' own dtype).
* **FSDP1** (``FullyShardedDataParallel``), refused rather than warned about: it has a ``.module``
  and a ``no_sync`` as DDP has, so it was taken for a DDP-like wrapper and its inner module was
  trained, whose parameters are views of FSDP1's flat parameter (``fit()`` failed in autograd,
  "a view ... has been modified inplace", naming nothing to change).
"""

from __future__ import annotations

import logging
import weakref

import torch

__all__ = ["warn_forward_collectives", "warn_compiled_wrapper", "warn_unused_ddp_options", "refuse_fsdp1"]

log = logging.getLogger("autobatch")
#: what each model was warned about already
_WARNED: "weakref.WeakKeyDictionary[torch.nn.Module, set[str]]" = weakref.WeakKeyDictionary()


def _first_time(model: torch.nn.Module, kind: str) -> bool:
    """Whether ``model`` is not yet warned about ``kind`` (and is now)."""
    seen = _WARNED.setdefault(model, set())
    if kind in seen:
        return False
    seen.add(kind)
    return True


def refuse_fsdp1(model: torch.nn.Module) -> None:
    """``ValueError`` where ``model`` is, holds, or is ``torch.compile`` of an FSDP1
    ``FullyShardedDataParallel`` module (module docstring), naming the wrappers autobatch drives."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a build without FSDP1
        return
    names = [name or "the model" for name, module in getattr(model, "_orig_mod", model).named_modules()
             if isinstance(module, FullyShardedDataParallel)]
    if names:
        raise ValueError(
            f"{names[0]} is a FullyShardedDataParallel (FSDP1) module, which autobatch cannot train or probe across "
            "ranks (it would train FSDP1's inner module, whose parameters are views of its flat parameter): shard "
            "with torch.distributed.fsdp.fully_shard (FSDP2) instead, or wrap the model in "
            "torch.nn.parallel.DistributedDataParallel"
        )


def warn_forward_collectives(model: torch.nn.Module) -> None:
    """A warning, once per model, where ``model`` holds a ``torch.nn.SyncBatchNorm`` (module
    docstring): which module, why an OOM in it is not replayed, and what to change."""
    names = [name or type(module).__name__ for name, module in model.named_modules()
             if isinstance(module, torch.nn.SyncBatchNorm)]
    if not names or not _first_time(model, "SyncBatchNorm"):
        return
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    log.warning(
        "%s %s SyncBatchNorm, whose forward all-gathers across ranks: an out-of-memory error on one rank "
        "inside it cannot be replayed (the other ranks wait in that collective until the process group's "
        "timeout), so autobatch's probe trials and OOM replay are not safe here; use BatchNorm (per-rank "
        "statistics, as DDP keeps them without SyncBatchNorm) to have them, or train at a fixed micro_batch "
        "well under the memory limit", shown, "is a" if len(names) == 1 else "are",
    )


def warn_compiled_wrapper(model: torch.nn.Module) -> None:
    """A warning, once per model, for ``torch.compile(DDP(model))`` (module docstring), naming
    the layout that trains compiled."""
    wrapper = getattr(model, "_orig_mod", None)
    if not isinstance(wrapper, torch.nn.parallel.DistributedDataParallel) or not _first_time(model, "compiled"):
        return
    log.warning(
        "the model is torch.compile(DistributedDataParallel(...)): autobatch trains DDP's module, which is not "
        "compiled, so the compilation is not used; compile inside the wrapper instead, "
        "DistributedDataParallel(torch.compile(module)), which trains compiled and through DDP's own reducer"
    )


#: hooks that compute what the runner's one all-reduce does (the mean over the ranks): nothing lost
_PLAIN_ALL_REDUCE = {"allreduce_hook", "BuiltinCommHookType.ALLREDUCE"}


def warn_unused_ddp_options(wrapper: torch.nn.parallel.DistributedDataParallel, hook: str | None) -> None:
    """A warning, once per model, where a DDP ``wrapper`` trained through its local module has a
    communication ``hook`` (its name) or ``mixed_precision`` that the runner's step does not apply
    (module docstring), naming what to change."""
    unused = [f"its communication hook ({hook})"] if hook and hook not in _PLAIN_ALL_REDUCE else []
    if getattr(wrapper, "mixed_precision", None) is not None:
        unused.append("its mixed_precision")
    if not unused or not _first_time(wrapper, "unused DDP options"):
        return
    log.warning(
        "the DistributedDataParallel model is trained through its local module (find_unused_parameters, static_graph, "
        "a communication hook or mixed_precision send it there), with one all-reduce of the gradients in their own "
        "dtype after backward: %s %s not applied. The runner cannot apply either: drop the hook (DDP's default "
        "all-reduce; without find_unused_parameters and static_graph the runner then drives DDP's own bucketed "
        "reducer), and for a lower-precision forward pass Runner(autocast_dtype=torch.bfloat16) instead of "
        "mixed_precision",
        " and ".join(unused), "is" if len(unused) == 1 else "are",
    )
