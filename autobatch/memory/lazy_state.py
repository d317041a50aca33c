"""An optimizer step that runs out of memory while it creates its state, undone between trials.

Most torch optimizers create a parameter's state on its first step, key by key: Adam sets
``step``, then allocates ``exp_avg``, then ``exp_avg_sq`` (twice the parameters' bytes in
all). A probe trial that runs out of memory in between leaves a state dict with some of the
keys, and the next trial's step raises ``KeyError: 'exp_avg'``, not an out-of-memory error, so
the probe stopped with it (found on the CPU's simulated device: an MLP under a 12 MiB cap).
:class:`LazyStateWatch` remembers which parameters had state as each step began and, after an
out-of-memory error inside a step, drops the state that step created, so the next trial
creates it whole again (any optimizer: a plain callable's too, through torch's global step
hooks). Values the step may have half-written are the snapshot's business
(:mod:`~autobatch.probe.snapshot.restore`); the runner's step guard does both for training.

:meth:`LazyStateWatch.drop_created` goes further: it drops all the state the probe's steps
created, so that the next step creates it again (:mod:`~autobatch.probe.pinned_state` says
when the probe does that, and why).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

__all__ = ["LazyStateWatch", "hooked", "state_values"]


class LazyStateWatch:
    """Watch every optimizer's ``step()`` while a probe runs (torch's global step hooks, so a
    plain callable's own optimizer is watched too) so that an OOM inside one cannot leave
    half-created state behind for the next trial.

    Optimizers are held weakly, and the parameters that had state by id: a function that builds
    its model and optimizer in every call (Accelerate's pattern) lets each attempt's go when
    the attempt ends, where strong references kept every failed attempt's weights, gradients
    and moments until the search ended (each attempt then started with less room, down to
    batch 1)."""

    def __init__(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        # each running step's optimizer and the ids of the parameters that had state as it began
        self._running: dict[int, tuple[torch.optim.Optimizer, set[int]]] = {}
        # every live optimizer seen stepping, and the ids of the parameters that had state when first seen
        self._seen: dict[int, tuple[weakref.ref, set[int]]] = {}
        self._hooks = [register_optimizer_step_pre_hook(self._began), register_optimizer_step_post_hook(self._ended)]
        #: how many times :meth:`drop_created` ran: state remembered before a drop is gone
        self.drops = 0
        #: how many optimizer steps began, an optimizer dropped since included
        self.steps_seen = 0
        #: how many of them began with no gradient on any parameter their optimizer trains (it stepped nothing)
        self.gradless_steps = 0
        #: how many optimizers were seen stepping, and whether any stepped twice or made state
        self.optimizers_seen, self.stepped_again, self.made_state = 0, False, False
        self._steps: dict[int, int] = {}  # steps of each live optimizer seen

    def _began(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        had = {id(param) for param, state in optimizer.state.items() if _holds(state)}
        self.steps_seen += 1
        self.gradless_steps += not any(param.grad is not None for group in optimizer.param_groups
                                       for param in group["params"])
        key = id(optimizer)
        self._running[key] = (optimizer, had)
        if key not in self._seen:
            seen, steps = self._seen, self._steps
            self._seen[key] = (weakref.ref(optimizer, lambda _, key=key: (seen.pop(key, None), steps.pop(key, None))), had)
            self.optimizers_seen += 1
        self._steps[key] = self._steps.get(key, 0) + 1
        self.stepped_again = self.stepped_again or self._steps[key] > 1

    def _watched(self) -> Iterator[tuple[torch.optim.Optimizer, set[int]]]:
        """Every optimizer seen stepping that is still alive, with its ``had`` ids."""
        for ref, had in list(self._seen.values()):
            optimizer = ref()
            if optimizer is not None:
                yield optimizer, had

    def stepped(self) -> list[torch.optim.Optimizer]:
        """Every optimizer seen stepping that is still alive (one built and dropped inside a
        plain callable's call is not)."""
        return [optimizer for optimizer, _ in self._watched()]

    def _ended(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self._running.pop(id(optimizer), None)
        self.made_state = self.made_state or any(_holds(state) for state in optimizer.state.values())

    def repair(self) -> int:
        """After an out-of-memory error: drop the state created by the steps it interrupted.
        Returns how many parameters lost their (partial) state; 0 when no step was running."""
        dropped = _drop_new(self._running.values())
        self._running.clear()
        return dropped

    def has_created(self) -> bool:
        """Whether a watched optimizer holds state it did not have when it was first seen."""
        return any(id(param) not in had for optimizer, had in self._watched() for param in optimizer.state)

    def drop_created(self) -> int:
        """Drop the state every watched optimizer created since it was first seen (state it had
        before, e.g. of a resumed run, stays). Returns how many parameters lost theirs."""
        self.drops += 1
        return _drop_new(self._watched())

    def created_on(self, device: torch.device) -> list[tuple[torch.optim.Optimizer, list[torch.Tensor]]]:
        """Each watched optimizer with the plain tensors of the state it created on ``device``
        (what :func:`~autobatch.memory.parking.park_until_step` moves); state it had before is not
        listed, nor tensor subclasses (a DTensor's shards, the fake tensors of an estimate's trace)."""
        found = []
        for optimizer, had in self._watched():
            tensors = [value for param, state in optimizer.state.items() if id(param) not in had
                       for value in state_values(state) if type(value) is torch.Tensor and value.device == device]
            if tensors:
                found.append((optimizer, tensors))
        return found

    def growth_from_now(self, device: torch.device) -> Callable[[], int]:
        """A reading of how many bytes the optimizers seen stepping so far hold on ``device`` in
        state and their parameters' gradients beyond what they hold now (never negative).

        After a trial that ran out of memory, memory still allocated above the trial's start is
        either garbage an older collection would free or live state: the optimizer state its
        completed first step made (a trial beside state made afresh, :mod:`~autobatch.probe.fresh_layout`),
        a plain callable's gradients. Only garbage is worth a full collection (~0.05-0.15 s),
        so the trial subtracts this growth. Optimizers first seen later are left out: one built
        inside a plain callable at each call (Accelerate's pattern) is a failed attempt's garbage."""
        known = [(ref, had) for ref, had in self._seen.values()]
        before = _held_bytes(known, device)

        def growth() -> int:
            return max(0, _held_bytes(known, device) - before)

        return growth

    def close(self) -> None:
        """Remove the hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def __enter__(self) -> "LazyStateWatch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


#: the caching allocator's smallest block: it counts every allocation rounded up to a multiple of it
_BLOCK = 512


def _held_bytes(known: list[tuple[weakref.ref, set[int]]], device: torch.device) -> int:
    """Bytes of the state tensors and parameter gradients of the live optimizers in ``known`` on
    ``device``, each storage once, rounded up as the caching allocator counts them."""
    storages: dict[int, int] = {}
    for ref, _ in known:
        optimizer = ref()
        if optimizer is None:
            continue
        tensors = [value for state in optimizer.state.values() for value in state_values(state)
                   if isinstance(value, torch.Tensor)]
        tensors += [param.grad for group in optimizer.param_groups for param in group["params"]
                    if param.grad is not None]
        for tensor in tensors:
            if type(tensor) is torch.Tensor and tensor.device == device and not tensor.is_sparse:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = -(-storage.nbytes() // _BLOCK) * _BLOCK
    return sum(storages.values())


def state_values(state: object) -> Iterable[object]:
    """A parameter's optimizer state as values: torch's optimizers keep a dict; a custom one may
    keep a bare tensor (or anything else), which every optimizer step hook here must get past."""
    if isinstance(state, Mapping):
        return state.values()
    return (state,)


def _holds(state: object) -> bool:
    """Whether a parameter's optimizer state holds anything (a bare tensor's truth is ambiguous)."""
    return len(state) > 0 if isinstance(state, Mapping) else state is not None


def _drop_new(entries: Iterable[tuple[torch.optim.Optimizer, set[int]]]) -> int:
    """Drop each optimizer's state for the parameters whose ids are not in its ``had`` set; how
    many lost theirs."""
    dropped = 0
    for optimizer, had in entries:
        created = [param for param in list(optimizer.state) if id(param) not in had]
        for param in created:
            del optimizer.state[param]
        dropped += len(created)
    return dropped


def hooked(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer whose step hooks fire: a wrapper that never ran
    ``Optimizer.__init__`` (Accelerate's ``AcceleratedOptimizer``) steps the one it holds as
    ``.optimizer``, and has no hooks of its own to register."""
    for _ in range(4):  # wrappers of wrappers, a few deep at most
        if hasattr(optimizer, "_optimizer_step_pre_hooks") or not hasattr(optimizer, "optimizer"):
            break
        optimizer = optimizer.optimizer
    return optimizer
