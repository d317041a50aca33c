"""FSDP2's collectives, entered only when every rank voted to enter them.

An FSDP2 step (``fully_shard``) all-gathers each block's parameters in forward and again in
backward, and reduce-scatters its gradients in backward. If one rank runs out of memory
between two of them, the others would wait in the next one for a rank that never comes.

The design (see ``docs`` "FSDP2"): every collective FSDP issues is preceded by a **vote**.
FSDP2 calls its all-gather and reduce-scatter through replaceable ``Comm`` objects; :func:`guard`
wraps each FSDP param group's with ``VotingAllGather`` / ``VotingReduceScatter`` (:func:`_voting_comms`),
which vote (a sync point through the process group's store, :mod:`.store_exchange`)
*after* FSDP allocated the buffers and *before* the real collective is issued. A step runs
inside :func:`voting`, whose :class:`Ballot` gives every vote of the step the same label, so
that any vote pairs with any other (each vote also carries what it precedes, an all-gather, a
reduce-scatter or a step boundary, and its number in the step: healthy ranks at *different*
collectives, whose micro-batches or modules run differ, raise
:class:`~autobatch.errors.RankDisagreementError` at once instead of pairing them):

* a healthy rank votes "ok" at each collective and at the step's end;
* a rank whose step raised (an OOM anywhere: compute, FSDP's buffer allocation, the
  optimizer) resets FSDP's per-iteration state and casts **one** "failed" vote, which pairs
  with whatever vote its peers reach next. They see the failure and raise
  :class:`~autobatch.errors.PeerOutOfMemoryError` from inside FSDP's hook (or
  :class:`~autobatch.errors.PeerFailedError` for any other error), which unwinds their forward
  or backward; they reset FSDP's state too.

So a real collective is issued by every rank or by none, and after a failure every rank
has made the same number of votes: no rank is left inside a collective. What remains (a
rank that died, user code that runs collectives of its own) ends in
:class:`~autobatch.errors.RankDisagreementError` after the sync timeout.

Resetting before the replay: ``FSDPModule.reset_iter_state()`` on every FSDP root (waits
for the collectives already issued, which every rank issued, reshards every group and clears
the iteration's trackers); on torch < 2.13, or before FSDP's lazy init ran (a failure before
the model's first forward, where torch's ``reset_iter_state`` fails on state that does not
exist yet and hid the failure), :func:`reset_iter_state`; the unsharded gradients that
accumulation micro-batches left (which ``reset_iter_state`` keeps) dropped; gradient sync on.

Roots: a model whose own root is not ``fully_shard`` -ed (only its blocks are) has one FSDP
root per outermost sharded module (:func:`fsdp_roots`); every one of them is reset and has
its gradient sync switched. Its other, plain parameters are replicated: the step all-reduces
their gradients itself (:mod:`.fsdp_passes`).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from functools import cache
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import PeerFailedError, PeerOutOfMemoryError, RankDisagreementError
from ..memory.oom import is_oom_error
from ..training.phases import PHASES
from . import agreement as dist_sync
from .leaving import describe, publish
from .store_exchange import exchange_via_store

__all__ = [
    "Ballot", "voting", "guard", "reset", "reset_iter_state", "is_fsdp", "fsdp_modules", "fsdp_roots", "no_gradient_sync",
    "STEP", "ALL_GATHER", "REDUCE_SCATTER",
]

_OK, _OOM, _ERROR = 0, 1, 2
#: what a vote comes before: a boundary of the step itself, or one of FSDP's collectives
STEP, ALL_GATHER, REDUCE_SCATTER = 0, 1, 2
_KINDS = ("a step vote", "an all-gather", "a reduce-scatter")
_PAYLOAD = 2  # integers a vote carries (fixed: any vote of a step must pair with any other)
_current: list["Ballot"] = []


def _fsdp_module_class() -> type | None:
    """``FSDPModule`` once ``torch.distributed.fsdp`` is loaded, else None: no module is
    ``fully_shard`` -ed before that (importing it costs a process about a second, so
    ``import autobatch`` leaves it to the user's ``fully_shard``)."""
    return getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)


def fsdp_modules(model: torch.nn.Module) -> list[Any]:
    """Every ``fully_shard`` -ed module (``FSDPModule``) in ``model``, outermost first."""
    fsdp_module = _fsdp_module_class()
    if fsdp_module is None:
        return []
    return [module for module in model.modules() if isinstance(module, fsdp_module)]


def is_fsdp(model: Any) -> bool:
    """Whether ``model`` is, or contains, an FSDP2 module."""
    return isinstance(model, torch.nn.Module) and any(True for _ in fsdp_modules(model))


def fsdp_roots(model: torch.nn.Module) -> list[Any]:
    """FSDP's roots in ``model``: every FSDP module inside no other one. One (the model) when
    the model itself is ``fully_shard`` -ed; one per sharded block when only blocks are."""
    roots: list[Any] = []
    inside: set[int] = set()
    fsdp_module = _fsdp_module_class()
    if fsdp_module is None:
        return roots
    for module in model.modules():  # parents come before their children
        if id(module) in inside:
            continue
        if isinstance(module, fsdp_module):
            roots.append(module)
            inside.update(id(child) for child in module.modules())
    return roots


class Ballot:
    """The votes of one step. ``phase()`` tells where this rank is (a name of ``PHASES``)."""

    def __init__(self, label: str, phase: Callable[[], str] = lambda: "forward") -> None:
        self.label = label
        self.phase = phase
        self.settled = False  # a vote already told every rank that the step failed
        self.votes = 0

    def vote(
        self, failure: BaseException | None = None, payload: int | Sequence[int] = (), kind: int = STEP
    ) -> list[list[int]]:
        """One vote before a collective of ``kind``: every rank's ``payload`` (up to two
        integers, zeros after). Raises on every rank when some rank failed: the failing rank
        its own error, the others a peer error; and when healthy ranks reached different
        collectives (:class:`~autobatch.errors.RankDisagreementError`)."""
        code = _OK if failure is None else (_OOM if is_oom_error(failure) else _ERROR)
        phase = self.phase()
        index = PHASES.index(phase) if phase in PHASES else -1
        self.votes += 1
        if code == _ERROR:
            publish(failure)  # the peers' PeerFailedError names it
        values = [payload] if isinstance(payload, int) else list(payload)
        values = [int(v) for v in values] + [0] * (_PAYLOAD - len(values))
        try:
            with _disable_current_modes():  # a simulated budget must not count (or refuse) the vote
                rows = exchange_via_store([code, index, kind, self.votes, *values], f"{self.label}: FSDP vote")
        except RankDisagreementError:
            # the vote itself failed (a peer past the deadline, a dead store): the ranks are out of
            # step, so no "failed" vote follows (it only waited another whole deadline)
            self.settled = True
            raise
        errors = [r for r, row in enumerate(rows) if row[0] == _ERROR]
        ooms = [r for r, row in enumerate(rows) if row[0] == _OOM]
        if not errors and not ooms:
            if any(row[2:4] != rows[0][2:4] for row in rows):
                self._mispaired(rows)
            return [row[4:] for row in rows]
        self.settled = True
        if failure is not None:
            raise failure
        if errors:
            raise PeerFailedError(
                f"rank {', '.join(map(str, errors))} raised an error in {self.label} ({describe(errors)}; see that rank's log); "
                f"rank {dist_sync.rank()} leaves the step too instead of waiting in a collective", errors,
            )
        where = PHASES[rows[ooms[0]][1]] if rows[ooms[0]][1] >= 0 else "an unknown phase"
        raise PeerOutOfMemoryError(
            f"rank {', '.join(map(str, ooms))} ran out of memory in {where} ({self.label}); "
            f"rank {dist_sync.rank()} left FSDP's collectives with it and replays", where, ooms,
        )

    def _mispaired(self, rows: list[list[int]]) -> None:
        """Healthy ranks at different collectives of the step: every rank raises (they all
        see the same rows) before any of them issues the collective."""
        self.settled = True
        me = dist_sync.rank()
        doing = {r: f"vote {row[3]} of {self.label}, before {_KINDS[row[2]]}" for r, row in enumerate(rows)}
        raise RankDisagreementError(
            me, f"vote {rows[me][3]} of {self.label}, before {_KINDS[rows[me][2]]}", doing,
            reason="the ranks reached different collectives of FSDP's step (their forward ran different "
                   "modules or a different number of micro-batches), so none of them is issued",
        )

    def fail(self, failure: BaseException) -> None:
        """This rank's step raised ``failure``: cast the one "failed" vote (unless a vote
        already settled it) and raise."""
        if not self.settled:
            self.vote(failure)
        raise failure


@contextmanager
def voting(label: str, phase: Callable[[], str] = lambda: "forward") -> Iterator[Ballot]:
    """Run a step whose FSDP collectives vote on this :class:`Ballot` first."""
    ballot = Ballot(label, phase)
    _current.append(ballot)
    try:
        yield ballot
    finally:
        _current.remove(ballot)


def _check(kind: int) -> None:
    if _current:
        _current[-1].vote(kind=kind)


@cache
def _voting_comms() -> tuple[type, type]:
    """``(VotingAllGather, VotingReduceScatter)``: FSDP's all-gather and reduce-scatter, each
    issued only after every rank voted "ok" (within :func:`voting`). Made at first use, as
    subclasses of FSDP's comm interfaces (``object`` on a torch without replaceable comms), so
    that importing autobatch does not import FSDP."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError:  # pragma: no cover - an older torch: FSDP2 without replaceable comms
        AllGather = ReduceScatter = object  # type: ignore[assignment,misc]

    class VotingAllGather(AllGather):
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def allocate(self, size, *, dtype, device):
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            _check(ALL_GATHER)
            return self.inner(output_tensor, input_tensor, group, async_op)

    class VotingReduceScatter(ReduceScatter):
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def allocate(self, size, *, dtype, device):
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            _check(REDUCE_SCATTER)
            return self.inner(output_tensor, input_tensor, group, op, async_op)

    return VotingAllGather, VotingReduceScatter


def guard(model: torch.nn.Module) -> torch.nn.Module:
    """Make every FSDP param group in ``model`` vote before its collectives (idempotent)."""
    for module in fsdp_modules(model):
        all_gather, reduce_scatter = _voting_comms()
        for group in _param_groups(module._get_fsdp_state()):
            if not isinstance(group._all_gather_comm, all_gather):
                group._all_gather_comm = all_gather(group._all_gather_comm)
            if not isinstance(group._reduce_scatter_comm, reduce_scatter):
                group._reduce_scatter_comm = reduce_scatter(group._reduce_scatter_comm)
    return model


def reset(model: torch.nn.Module) -> None:
    """Put FSDP's per-iteration state back to idle after a step that raised: every root's
    groups resharded, in-flight (already agreed) collectives waited for, gradient sync on."""
    for root in fsdp_roots(model):
        initialised = root._get_fsdp_state()._is_root is not None
        if initialised and hasattr(root, "reset_iter_state"):
            root.reset_iter_state()
        else:  # torch < 2.13, or a failure before FSDP's lazy init (torch's reset fails there)
            reset_iter_state(root)
    # reset_iter_state keeps the unsharded gradients that micro-batches without gradient sync
    # accumulated: a replay would add onto the failed step's, so they go too
    for module in fsdp_modules(model):
        for group in _param_groups(module._get_fsdp_state()):
            for param in group.fsdp_params:
                param.unsharded_accumulated_grad = None
                unsharded = getattr(param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None
    for root in fsdp_roots(model):
        root.set_requires_gradient_sync(True)


def reset_one_process(model: torch.nn.Module) -> None:
    """:func:`reset` for a ``fully_shard`` model trained in one process (a group of one rank, the
    runner's and the probe's one-process paths, which call it after a failed step through
    :func:`autobatch.probe.snapshot.ddp_reducer.reset_failed_reduction`). Without it an OOM part-way through
    backward left the unsharded gradients of the layers whose reduce-scatter had not run on their
    unsharded parameters, the replay's backward added onto them, and the step's weights came out
    wrong without a word. Across ranks the voted step resets (:func:`autobatch.dist.fsdp.fsdp_step`)."""
    if not dist_sync.is_distributed() and is_fsdp(model):
        reset(model)


def reset_iter_state(root: Any) -> None:
    """``FSDPModule.reset_iter_state()`` (torch 2.13) for older torch, on its private state:
    wait for the collectives already issued, clear the iteration's trackers, put every state
    and param group back to idle and reshard every group. Plain ``reshard()`` is not enough
    after a failure in forward: it keeps the root unsharded (FSDP does not reshard the root
    after forward), so the next step would see full-size parameters."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    state = root._get_fsdp_state()
    if state._is_root is None:  # failed before FSDP's lazy init finished: nothing is in flight
        for module in fsdp_modules(root):
            module.reshard()
        return
    stream = state._device_handle.current_stream()
    ctx = state._comm_ctx

    def wait(event: Any) -> None:
        if event is not None:
            stream.wait_event(event)

    if ctx.all_gather_state is not None:
        wait(ctx.all_gather_state.event)
        ctx.all_gather_state = None
    if hasattr(ctx, "reduce_scatter_states"):
        for rs_state in ctx.reduce_scatter_states:
            wait(rs_state.event)
        ctx.reduce_scatter_states.clear()
    elif getattr(ctx, "reduce_scatter_state", None) is not None:
        wait(ctx.reduce_scatter_state.event)
        ctx.reduce_scatter_state = None
    for event in getattr(ctx, "_last_post_reduce_events", {}).values():
        wait(event)
    getattr(ctx, "_last_post_reduce_events", {}).clear()
    ctx.post_forward_order.clear()
    for each in state._state_ctx.all_states:
        each._modules_to_run_forward.clear()
        each._training_state = TrainingState.IDLE
        for group in _param_groups(each):
            _reset_group(group, wait, TrainingState.IDLE)
    state._state_ctx.iter_forward_root = None
    state._state_ctx.post_backward_final_callback_queued = False


def _reset_group(group: Any, wait: Callable[[Any], None], idle: Any) -> None:
    """One FSDP param group back to idle and sharded (torch 2.13's ``_reset_iter_state``)."""
    result = group._all_gather_result
    if result is not None:
        wait(result.all_gather_event)
        if isinstance(result.all_gather_work, torch.distributed.distributed_c10d.Work):
            result.all_gather_work.wait()
        group._all_gather_result = None
    wait(getattr(group, "_post_reduce_event", None))
    group._post_reduce_event = None
    all_reduce = getattr(group, "_all_reduce_state", None)
    if all_reduce is not None:
        wait(all_reduce.event)
    group._all_reduce_state = None
    event = getattr(group, "_reshard_after_forward_event", None)
    if event is not None:
        group._wait_all_gather_streams_on_event(event)
        group._reshard_after_forward_event = None
    group._partial_reduce_output = None
    group._post_forward_indices.clear()
    group._training_state = idle
    group._to_sharded()


@contextmanager
def no_gradient_sync(model: torch.nn.Module) -> Iterator[None]:
    """FSDP2's accumulation micro-batch: no reduce-scatter; gradients stay unsharded and add up
    until the last micro-batch's backward reduce-scatters them once."""
    roots = fsdp_roots(model)
    for root in roots:
        root.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        for root in roots:
            root.set_requires_gradient_sync(True)


def _param_groups(state: Any) -> list[Any]:
    """An FSDP state's parameter groups: a list in newer torch, one group (or None) in 2.11."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]
