"""One global step through DDP's own reducer, with the guarantee that no rank waits alone.

DDP overlaps its bucketed gradient all-reduce with the last micro-batch's backward; the runner
keeps that (``no_sync()`` on every micro-batch but the last) and adds the one thing DDP lacks:
a rank that fails part-way (an OOM in a micro-batch's transfer, forward or backward,
including the last backward while buckets are in flight) completes the collectives its peers
have entered or will enter, before every rank votes on the step.

The protocol, per global step (every rank, in this order):

1. **Prologue: DDP's forward-side collectives, moved before the first transfer.** The bucket
   rebuild (once after the first synced backward, and after every abandoned step) is DDP's own
   call, made here while every rank has just left the previous step's last sync point and
   holds no activations; then DDP's forward skips it. The buffer broadcast
   (``broadcast_buffers``: rank 0's BatchNorm statistics, once per step, which DDP makes at the
   first forward) is made at the end of the step before instead (:func:`settle`), so that a
   forward between steps on some ranks only (an evaluation) runs no collective. An error inside
   either is fatal on that rank (not replayed: the model does not fit even without
   activations) and the peers' wait ends with the backend's timeout.
2. **Micro-batches.** All but the last under ``no_sync()`` (no collective); the last through
   DDP, whose reducer launches its buckets in index order through a communication hook
   (:class:`BucketLedger`) that weights each bucket by ``share / global batch``, launches an
   asynchronous all-reduce (sum) and records the bucket's index. The launched buckets are
   therefore always a prefix ``0..k-1`` of the bucket order, which is the same on every rank.
   The hook stays on the model (DDP cannot remove one); between steps it is DDP's default
   all-reduce and records nothing (:class:`BucketLedger`).
3. **On any failure in 2** (a backward that left a bucket unlaunched too: a parameter that got
   no gradient, :func:`check_reduced`), on the failing rank only: drop the traceback, the gradients and
   the cached memory, then all-reduce **zero** buckets of the reducer's sizes for every bucket
   not yet launched (``k..N-1``, in order; DDP's own ``_get_zeros_like_grad_buckets``, the
   tool of its ``join`` for uneven inputs) and wait for all of them under the sync deadline.
   Every rank has then entered exactly the ``N`` bucket all-reduces of the step, whether it
   finished its backward, failed in it, or failed before it; several failing ranks complete
   alike. A peer blocked inside its backward waiting for those buckets (gloo) is released.
4. **Vote "gradients ready"** (a gloo sync point with a deadline): ok / OOM / error, phase,
   share. If any rank failed, every rank resets its reducer (``_reset_state``: DDP's own
   recovery path, so the next forward does not wait for the abandoned reduction, and the
   buckets are rebuilt on every rank alike), puts DDP's forward-sync flag back to what the
   step found (:func:`reset_after_failure`: the ranks failed at different forwards, and the
   flag decides whether the replay's prologue broadcasts buffers) and raises; the runner
   replays the same global batch with a halved micro-batch on every rank. Otherwise the summed buckets are the
   gradient of the mean over the global batch (rescaled once when the shares did not add up
   to the configured global batch).
5. **Optimizer step** under the runner's step guard, then the loss is read (the step is
   queued first, so the device does not idle while the host waits) and **vote "optimizer
   stepped"** carries it: an OOM inside any rank's step makes every rank restore and replay.

Every collective is thus entered by every rank or, when a rank dies outside autobatch, ends
in the sync deadline (:class:`~autobatch.errors.RankDisagreementError`) or the process
group's own timeout; no rank waits in a collective that another rank has decided to skip.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from ..errors import RankDisagreementError
from ..memory.oom import free_memory, is_oom_error
from ..planning.accumulation import accumulate_loss_sum
from ..probe.snapshot.ddp_reducer import ddp_wrapper
from ..probe.train_step import TrainStep
from . import agreement as dist_sync
from .votes import bits_float, float_bits, keep, vote

__all__ = [
    "BucketLedger", "comm_hook_name", "ddp_supported", "ddp_wrapper", "check_whole_world", "ledger_for", "run_prologue", "settle",
    "reset_after_failure", "complete_buckets", "check_reduced", "ddp_step",
]

_LEDGERS: "weakref.WeakKeyDictionary[torch.nn.Module, BucketLedger]" = weakref.WeakKeyDictionary()


class BucketLedger:
    """State of the communication hook: the weight of this rank's buckets and which buckets
    it has launched in the current step (their indices and asynchronous work handles).

    DDP keeps a communication hook for the model's whole life (it has no way to remove one),
    so the hook outlives the runner's steps: outside them (:meth:`end`) it is DDP's default
    all-reduce (mean over the group, :func:`allreduce_hook`) and records nothing, so a plain
    DDP backward on the model after ``fit`` or ``find_max_batch`` gets DDP's own gradient."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.weight = 1.0
        self.active = False  # inside one of autobatch's steps
        self.launched: list[int] = []
        self.works: list[Any] = []

    def begin(self, weight: float) -> None:
        """Start a step: forget the last step's buckets; weight this rank's by ``weight``."""
        self.weight = float(weight)
        self.active = True
        self.launched.clear()
        self.works.clear()

    def end(self) -> None:
        """The step is over (done or failed): back to DDP's default all-reduce, nothing held."""
        self.active = False
        self.launched.clear()
        self.works.clear()


def _first(future: Any) -> torch.Tensor:
    return future.value()[0]


def _ledger_hook(ledger: BucketLedger, bucket: Any) -> Any:
    """DDP's all-reduce of one bucket (weighted sum), recorded in the ledger once launched;
    outside autobatch's steps, DDP's default (the mean over the group), recording nothing."""
    if not ledger.active:
        return allreduce_hook(ledger.group, bucket)
    buffer = bucket.buffer()
    if ledger.weight != 1.0:
        buffer.mul_(ledger.weight)
    work = dist.all_reduce(buffer, group=ledger.group, async_op=True)
    ledger.launched.append(bucket.index())
    ledger.works.append(work)
    return work.get_future().then(_first)


# DDP checks a hook's annotations against its classes; this module's are strings (PEP 563)
_ledger_hook.__annotations__ = {}


def _has_comm_hook(model: torch.nn.parallel.DistributedDataParallel) -> bool:
    """Whether a communication hook is registered on ``model``: a Python one (``_comm_hooks``)
    or a built-in one (``_register_builtin_comm_hook``, which only DDP's logging data names)."""
    if getattr(model, "_comm_hooks", None):
        return True
    if getattr(model, "logger", None) is None:  # no logging data (no reducer): the Python list decides
        return False
    return bool(model._get_ddp_logging_data().get("comm_hook"))


def comm_hook_name(model: torch.nn.parallel.DistributedDataParallel) -> str | None:
    """The name of the communication hook registered on ``model`` (``fp16_compress_hook``,
    ``BuiltinCommHookType.FP16_COMPRESS``), or None where it has none."""
    if not _has_comm_hook(model):
        return None
    hooks = getattr(model, "_comm_hooks", None)
    if hooks:
        return getattr(hooks[0][0], "__qualname__", type(hooks[0][0]).__name__)
    return str(model._get_ddp_logging_data().get("comm_hook"))


def ddp_supported(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a DDP module this step can drive through its reducer: no
    ``find_unused_parameters`` or ``static_graph`` (their extra collectives are not in the
    completion protocol), no communication hook of the user's, no mixed-precision or
    Python reducer. Anything else trains through its local module (:mod:`autobatch.dist.step`)."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return False
    if model in _LEDGERS:
        return True
    return (
        getattr(model, "reducer", None) is not None
        and not model.find_unused_parameters
        and not model.static_graph
        and not getattr(model, "_use_python_reducer", False)
        and not getattr(model, "_delay_all_reduce_all_params", False)
        and getattr(model, "mixed_precision", None) is None
        and not _has_comm_hook(model)
    )


def check_whole_world(model: torch.nn.Module) -> None:
    """``ValueError`` unless a DDP ``model`` replicates over every rank of the job. The
    runner splits each global batch over all ranks, weights gradients by ``share / global``
    over all of them and votes over all of them; a DDP over a sub-group (two replica groups
    of 2 in a job of 4) averages over its own group only, and its gradients came out halved."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel) or not dist_sync.is_distributed():
        return
    size, world = dist.get_world_size(model.process_group), dist_sync.world_size()
    if size != world:
        raise ValueError(
            f"the DDP model's process group has {size} of the job's {world} ranks; autobatch splits each global "
            "batch over every rank of the job (the default group), so its gradients would be wrong: build the DDP "
            "model over the whole job (process_group=None), or launch each replica group as its own torchrun job"
        )


def ledger_for(model: torch.nn.parallel.DistributedDataParallel) -> BucketLedger:
    """The ledger of ``model``, registering the recording hook on first use (once per model:
    DDP takes one hook per model and never lets it go, see :class:`BucketLedger`)."""
    ledger = _LEDGERS.get(model)
    if ledger is None:
        if _has_comm_hook(model):  # ddp_supported sends these to the local module; never here
            raise ValueError(
                "this DDP model already has a communication hook, and DDP allows one: autobatch's step through DDP "
                "needs its own; pass the model without registering a hook (autobatch then trains it through its "
                "local module with one agreed all-reduce)"
            )
        ledger = BucketLedger(model.process_group)
        model.register_comm_hook(ledger, _ledger_hook)
        _LEDGERS[model] = ledger
    return ledger


def run_prologue(model: torch.nn.parallel.DistributedDataParallel, label: str, *, buffers: bool = True) -> bool:
    """DDP's pre-forward collectives (bucket rebuild, buffer broadcast), run now, in DDP's
    order, so that nothing a single rank can fail in comes before them in the step. Returns
    DDP's forward-sync flag as the step found it, for :func:`reset_after_failure`.
    ``buffers=False``: no buffer broadcast, whatever that per-rank flag says (the runner's
    step: :func:`settle` sent them after the previous step, and code between steps, a forward
    on some ranks only, may have set the flag on those ranks only)."""
    forward_sync = bool(model.require_forward_param_sync)
    try:
        if torch.is_grad_enabled() and model.reducer._rebuild_buckets():
            model._has_rebuilt_buckets = True
        if buffers and model._check_sync_bufs_pre_fwd():
            model._sync_buffers()
        model.require_forward_param_sync = False  # done: the first forward must not repeat it
        return forward_sync
    except Exception as exc:  # noqa: BLE001 - fatal, and said so; never replayed
        if not is_oom_error(exc):  # a peer that never came (timeout) or died
            raise dist_sync.collective_failed(f"{label}: DDP's bucket rebuild / buffer broadcast", exc) from exc
        # the allocator's message is left to the chained error: quoted here it made this error
        # an OOM by is_oom_error, which the runner would replay inside a collective its peers hold
        raise RuntimeError(
            f"rank {dist_sync.rank()} failed inside DDP's bucket rebuild or buffer broadcast at {label!r} "
            f"({type(exc).__name__}, the error above: memory ran short there); this cannot be replayed (the other "
            "ranks are inside the same collective), so the run stops"
        ) from exc


def settle(model: torch.nn.Module, label: str) -> None:
    """After a step every rank completed (every rank, in step): what DDP would do at the next
    forward is done now, so that no forward between steps runs a collective. A DDP model driven
    through its reducer gets its pending bucket rebuild and rank 0's buffers (its own
    ``_sync_buffers``, where ``broadcast_buffers`` asks for it; the runner's next prologue then
    sends none); any DDP wrapper's forward-sync flag is cleared, so its next forward does not
    broadcast the buffers again. Before, that broadcast ran at the next forward, and a forward
    some ranks only ran (``on_step_end`` evaluating a BatchNorm model on rank 0, or evaluating
    after ``fit``) entered it alone: the ranks waited out the sync deadline, and the ranks' buffers
    differed after ``fit`` (each rank's last step's statistics)."""
    if ddp_supported(model):  # trained through its reducer: after a synced step the flag is True on every rank
        run_prologue(model, f"{label}: DDP's buffers")
    wrapper = ddp_wrapper(model)
    if wrapper is not None:  # the buffers are rank 0's already
        wrapper.require_forward_param_sync = False


def reset_after_failure(model: torch.nn.parallel.DistributedDataParallel, forward_sync: bool) -> None:
    """After a step some rank failed, on every rank: DDP's reducer recovery (``_reset_state``)
    and DDP's per-rank forward-sync flag put back to what the step found
    (:func:`run_prologue`'s answer, the same on every rank). DDP sets that flag in each
    forward (True after a synced one, False under ``no_sync``), so a rank that failed before
    its last micro-batch's forward held False while a peer that got past it held True: the
    replay's prologue then broadcast buffers (BatchNorm) on one rank only, and the ranks hung
    in different collectives."""
    model.reducer._reset_state()
    model.require_forward_param_sync = forward_sync


def check_reduced(model: torch.nn.parallel.DistributedDataParallel, label: str) -> None:
    """After this rank's synced backward through DDP succeeded: ``ValueError`` unless DDP's reducer
    reduced every bucket. A parameter that needs a gradient but got none (a branch forward skipped,
    on some ranks or all) leaves its bucket unlaunched under DDP's default
    ``find_unused_parameters=False``: a peer that launched it waited in its backward until the
    process group's timeout, and where every rank skipped it the step went on with gradients that
    were never all-reduced (the ranks' weights came apart) until DDP's own error at the next step.
    Raised inside the step, the caller completes the buckets with zeros and votes, so every rank
    stops at this step: this rank with this error, its peers with ``PeerFailedError``."""
    finalized = getattr(model.reducer, "_check_reducer_finalized", None)
    if finalized is None:  # not in this torch: DDP raises at the next step instead
        return
    try:
        finalized()
    except RuntimeError as exc:
        missing = [name for name, param in model.module.named_parameters() if param.requires_grad and param.grad is None]
        named = f" ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''} got none)" if missing else ""
        raise ValueError(
            f"rank {dist_sync.rank()}: DDP could not all-reduce every gradient at {label!r}: parameters that require "
            f"grad got no gradient in the backward{named}, and DistributedDataParallel(find_unused_parameters=False) "
            "waits for every one. Pass find_unused_parameters=True to DistributedDataParallel (autobatch then trains "
            "through the local module and all-reduces once after backward), or freeze what the loss never uses "
            "(requires_grad_(False)); DDP's own error, chained, gives the parameters' indices"
        ) from exc


def complete_buckets(model: torch.nn.parallel.DistributedDataParallel, ledger: BucketLedger, label: str) -> None:
    """On a rank whose step failed: all-reduce zeros for every bucket it has not launched,
    in bucket order, and wait (under the sync deadline) for every bucket of the step."""
    try:
        launched = set(ledger.launched)
        works = list(ledger.works)
        for bucket in model.reducer._get_zeros_like_grad_buckets():
            if bucket.index() not in launched:
                works.append(dist.all_reduce(bucket.buffer(), group=ledger.group, async_op=True))
        for work in works:
            dist_sync.wait_for(work, label)
    except RankDisagreementError:
        raise
    except Exception as exc:  # noqa: BLE001 - an OOM here must not be replayed: the peers wait
        raise RuntimeError(
            f"rank {dist_sync.rank()} could not complete DDP's gradient buckets after its step failed "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})"
        ) from exc
    finally:
        ledger.begin(ledger.weight)


def _micro_batches(
    step: TrainStep, ledger: BucketLedger, micro_batches: Iterable[Any], weight: float, local_size: int,
    on_phase: Callable[[str], None], label: str,
) -> tuple[torch.Tensor | None, BaseException | None]:
    """Step 2 and 3 of the protocol: every micro-batch through DDP, buckets weighted by
    ``weight``; on a failure, this rank's unlaunched buckets completed with zeros. Returns
    (this rank's loss sum or None, the failure to vote on). The hook is DDP's default again
    afterwards, whatever happened (:meth:`BucketLedger.end`)."""
    model = step.model
    ledger.begin(weight)
    try:
        try:
            total, _ = accumulate_loss_sum(
                model, step.loss_fn, micro_batches, global_batch=local_size, autocast=step.autocast,
                grad_scaler=step.grad_scaler, no_sync=model.no_sync, on_phase=on_phase,
            )
            check_reduced(model, label)
            return total, None
        except Exception as exc:  # noqa: BLE001 - completed here, voted on by the caller, then re-raised
            failure = keep(exc)
        step.clear_grads()
        free_memory()
        complete_buckets(model, ledger, f"{label}: completing DDP's gradient buckets")
        return None, failure
    finally:
        ledger.end()


def ddp_step(
    step: TrainStep,
    micro_batches: Iterable[Any],
    *,
    local_size: int,
    global_batch: int,
    on_phase: Callable[[str], None],
    phase: Callable[[], str],
    label: str,
) -> tuple[float | torch.Tensor, int]:
    """One optimizer step over every rank's micro-batches through DDP (``step.model``);
    returns (mean loss over the global batch, global batch size), the same on every rank; on
    an accelerator the loss is a 0-dim tensor still being computed (``float()`` reads it).
    ``global_batch`` is the configured global batch (the buckets' weights assume it)."""
    model = step.model
    ledger = ledger_for(model)
    step.optimizer.zero_grad(set_to_none=True)
    forward_sync = run_prologue(model, label, buffers=False)  # sent after the step before (settle)
    total, failure = _micro_batches(step, ledger, micro_batches, local_size / global_batch, local_size, on_phase, label)
    reset = lambda: reset_after_failure(model, forward_sync)  # noqa: E731 - on every rank, when some rank failed
    rows = vote(failure, phase(), local_size, f"{label}: gradients ready", clear=step.clear_grads, on_failure=reset)
    global_size = sum(row[2] for row in rows)
    if global_size != global_batch:  # shares that do not add up: buckets were weighted by global_batch
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param.grad.mul_(global_batch / global_size)
    try:
        on_phase("optimizer")
        step.optimizer_step()
    except Exception as exc:  # noqa: BLE001 - voted on below, then re-raised
        failure = keep(exc)
    on_device = total is not None and total.device.type != "cpu"
    # on a CPU the loss rides in the vote; on an accelerator reading it would make the host wait
    # for the device every step, so it is summed over the ranks on the device, after the vote
    # (which every rank passed, so every rank enters that all-reduce), and read when reported
    extra = [] if on_device or total is None else [float_bits(float(total.item()))]
    rows = vote(failure, phase(), local_size, f"{label}: optimizer stepped", extra=extra, clear=step.clear_grads)
    step.optimizer.zero_grad(set_to_none=True)
    if not on_device:
        return sum(bits_float(row[3]) for row in rows) / global_size, global_size
    total = total.reshape(1).to(torch.float64)
    dist.all_reduce(total, group=ledger.group, async_op=True).wait()  # a stream wait, not a host wait
    return total[0] / global_size, global_size
