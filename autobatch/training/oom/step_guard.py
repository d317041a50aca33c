"""Make ``optimizer.step()`` transactional, so an OOM inside it can be replayed safely.

Why it is needed. Optimizers update parameters and their state in place, tensor by tensor
(or list by list with ``foreach``), and allocate while doing so: Adam's moments on its first
step, SGD's momentum buffers one parameter at a time, ``foreach`` temporaries on every step.
An OOM part-way leaves some parameters (and step counters, moments) updated and others not.
Replaying the global batch on top of that applies part of the update twice. Nothing about
the optimizer proves this cannot happen, so the runner does not assume it.

What it does. :meth:`StepGuard.capture` copies everything a step may change (every
parameter of the optimizer's groups, every tensor and value in ``optimizer.state``, the
groups' hyper-parameters) into persistent buffers before the step; :meth:`StepGuard.restore`
writes them back after a failed step, and drops state entries the failed step created
(Adam's moments on step 1), so the optimizer is exactly as it was. Gradients need no copy:
the replay recomputes them from scratch. With a ``GradScaler`` (fp16) the capture also holds
its scale and growth tracker, and a restore puts them back and forgets what ``unscale_`` /
``step`` recorded for the failed attempt, so the replay's inf/NaN check, skip decision and
``update()`` are those of a run that never failed.

Cost, by ``mode``:

* ``"auto"`` (default): ``"device"`` while the device has room to spare for the copy, else
  ``"cpu"``. ``room(nbytes)``, given by the runner, says whether the last step's measured peak
  plus ``nbytes`` still leaves a quarter of the device free; before a step was measured, and
  for the rest of the run after any out-of-memory error, the buffers are in host memory. So
  a run at the probed maximum (no room) copies to the host, and a run with memory to spare
  pays an on-device copy instead of a device-to-host one (on 2 x H200, GPT-2 small under DDP:
  the host copy cost +2.6 % per step, see ``docs/benchmarks.md``).
* ``"cpu"``: buffers in host memory (pinned on CUDA), so the guard costs no device
  memory, which is exactly what is short. On CUDA the runner issues the copy on a side stream when
  the step's first backward starts (parameters and optimizer state do not change until the
  optimizer step, and the queued forward hides the host's cost of issuing the copies); it
  overlaps backward, and the optimizer step waits for it. The host never
  waits. The device-to-host traffic is parameters + optimizer state per step (12 bytes per
  fp32 parameter with Adam); when forward/backward is shorter than that copy, the remainder
  shows up in step time (``scripts/bench_runner.py`` measures it).
* ``"device"``: buffers on the device: a fast on-device copy, but it costs as much device
  memory as the parameters and optimizer state.
* ``"off"``: no copy. An OOM inside ``optimizer.step()`` is then *not* replayed (the update
  may be half-applied); the runner raises instead of silently corrupting the model.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Mapping

import torch

from ... import checks
from ...memory.oom import is_oom_error
from ...memory.simulated import host_memory
from ...probe.snapshot.restore import forget_scaler_stage
from ...probe.snapshot.shards import is_dtensor, local_data, spec_of

__all__ = ["StepGuard", "GUARD_MODES", "GUARD_SPARE", "copy_all"]

GUARD_MODES = ("auto", "cpu", "device", "off")
#: other names users give a mode (the device by its type, the host), suggested where given
GUARD_ALIASES = {"gpu": "device", "cuda": "device", "accelerator": "device", "host": "cpu", "none": "off",
                 "false": "off", "disabled": "off"}
GUARD_SPARE = 0.25  # "auto" copies on the device only if a quarter of it stays free with the copy there
WHOLE = "<the parameter's whole state>"  # the key of a parameter's state that is a bare value, not a dict


class StepGuard:
    """Snapshot what ``optimizer.step()`` can change; put it back after a failed step."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        mode: str = "auto",
        grad_scaler: Any = None,
        room: Callable[[int], bool] | None = None,
    ) -> None:
        checks.choice("step_guard", mode, GUARD_MODES, aliases=GUARD_ALIASES)
        self.optimizer = optimizer
        self.mode = mode
        self.room = room
        self.placement = "cpu" if mode == "auto" else mode  # where the buffers are: "cpu" or "device"
        self.demoted = False
        self.grad_scaler = grad_scaler
        self._scaler_state: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        self._buffers: dict[tuple[int, Any], torch.Tensor] = {}
        self._params: list[torch.Tensor] = []
        self._state_keys: dict[int, dict[Any, Any]] = {}  # id(param) -> key -> non-tensor value, or None for a tensor
        self._groups: list[dict[str, Any]] = []
        self._own: dict[Any, Any] = {}  # state entries keyed by no parameter (a custom optimizer's own counter)
        self._stream = None
        self._captured = False

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    # -- capture ------------------------------------------------------------------------------
    def capture(self) -> None:
        """Copy parameters, optimizer state and group settings (asynchronously on CUDA)."""
        if not self.enabled:
            return
        self._params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self._groups = [{k: copy.copy(v) for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        self._state_keys = {}
        sources: list[tuple[tuple[int, Any], torch.Tensor]] = []
        for index, param in enumerate(self._params):
            sources.append(((index, None), param))
            state = self.optimizer.state.get(param)
            if state is None:
                continue
            keys: dict[Any, Any] = {}
            # torch's optimizers keep a dict per parameter; a custom one may keep a bare tensor (a momentum buffer)
            for key, value in (state.items() if isinstance(state, Mapping) else [(WHOLE, state)]):
                if isinstance(value, torch.Tensor):
                    keys[key] = None
                    sources.append(((index, key), value))
                else:
                    keys[key] = copy.deepcopy(value)
            self._state_keys[index] = keys
        self._own = self._own_state()
        # a DTensor (FSDP2) is copied as this rank's local shard: nothing is gathered
        sources = [(slot, local_data(source)) for slot, source in sources]
        if self.mode == "auto":
            self._place(sources)
        live = {slot for slot, _ in sources}
        for slot in list(self._buffers):
            if slot not in live:
                del self._buffers[slot]
        targets: list[torch.Tensor] = []
        for slot, source in sources:
            buffer = self._buffers.get(slot)
            if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
                buffer = self._buffers[slot] = self._empty_like(source)
            targets.append(buffer)
        with self._copy_stream():
            copy_all(targets, [source for _, source in sources])
        self._capture_scaler()
        self._captured = True

    def _capture_scaler(self) -> None:
        """The scaler's scale and growth tracker (two scalars, no sync: :meth:`_scalar_copy`)."""
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return
        scale, tracker = getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None)
        self._scaler_state = (self._scalar_copy(scale), self._scalar_copy(tracker))

    def _scalar_copy(self, value: torch.Tensor | None) -> torch.Tensor | None:
        """A copy of one of the scaler's scalars: on its device, or in host memory where the
        buffers are and it is a CPU tensor (on the simulated device, copies the trial never held)."""
        if value is None:
            return None
        if self.placement == "cpu" and value.device.type == "cpu":
            with host_memory():
                return value.clone()
        return value.clone()

    def _restore_scaler(self) -> None:
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return
        scale, tracker = self._scaler_state
        scaler._scale = None if scale is None else scale.clone()
        scaler._growth_tracker = None if tracker is None else tracker.clone()
        # unscale_/step of the failed attempt marked this optimizer; the replay starts afresh
        forget_scaler_stage(scaler, self.optimizer)

    def ready(self) -> None:
        """Make the current stream wait for the capture (before the optimizer writes anything)."""
        if self._stream is not None and self._captured:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)

    # -- restore ------------------------------------------------------------------------------
    def restore(self) -> None:
        """Write the capture back in place; drop optimizer state the failed step created."""
        if not self._captured:
            raise RuntimeError("StepGuard.restore() before capture()")
        self.ready()
        with torch.no_grad():
            for index, param in enumerate(self._params):
                local_data(param).copy_(self._buffers[(index, None)])
                saved = self._state_keys.get(index)
                if saved is None:
                    self.optimizer.state.pop(param, None)
                    continue
                if WHOLE in saved:  # a bare value of the parameter's own, not a dict
                    self._restore_whole(param, saved[WHOLE], self._buffers.get((index, WHOLE)))
                    continue
                state = self.optimizer.state[param]
                if not isinstance(state, Mapping):  # the failed step replaced the dict
                    state = self.optimizer.state[param] = {}
                for key in list(state):
                    if key not in saved:
                        del state[key]
                for key, value in saved.items():
                    if value is not None:
                        state[key] = copy.deepcopy(value)
                        continue
                    buffer = self._buffers[(index, key)]
                    current = state.get(key)
                    part = local_data(current) if isinstance(current, torch.Tensor) else None
                    if part is not None and part.shape == buffer.shape and part.dtype == buffer.dtype:
                        part.copy_(buffer)
                    else:
                        state[key] = self._fresh(buffer, current, param)
        for group, saved in zip(self.optimizer.param_groups, self._groups):
            group.update({key: copy.copy(value) for key, value in saved.items()})
        owned = {id(param) for param in self._params}
        for key in [key for key in self.optimizer.state if id(key) not in owned and key not in self._own]:
            del self.optimizer.state[key]  # created by the failed step
        self.optimizer.state.update(copy.deepcopy(self._own))
        self._restore_scaler()
        if any(p.device.type == "cuda" for p in self._params):
            torch.cuda.synchronize()

    # -- helpers ------------------------------------------------------------------------------
    def _restore_whole(self, param: torch.Tensor, value: Any, buffer: torch.Tensor | None) -> None:
        """Put back a parameter's state that is one bare value: ``value`` (not a tensor), else
        the tensor captured in ``buffer``, in place where the tensor there still fits."""
        if buffer is None:
            self.optimizer.state[param] = copy.deepcopy(value)
            return
        current = self.optimizer.state.get(param)
        part = local_data(current) if isinstance(current, torch.Tensor) else None
        if part is not None and part.shape == buffer.shape and part.dtype == buffer.dtype:
            part.copy_(buffer)
        else:
            self.optimizer.state[param] = self._fresh(buffer, current, param)

    def _own_state(self) -> dict[Any, Any]:
        """A copy of the optimizer state's entries that belong to no parameter of its groups (a
        custom optimizer's ``self.state["count"] = torch.tensor(...)``, a state value at its top
        level): a step that failed after changing one was replayed on top of the change (a count
        one ahead). Small values: copied whole, and copied again when put back."""
        owned = {id(param) for param in self._params}
        return copy.deepcopy({key: value for key, value in self.optimizer.state.items() if id(key) not in owned})

    @staticmethod
    def _fresh(buffer: torch.Tensor, current: Any, param: torch.Tensor) -> torch.Tensor:
        """A new state tensor from ``buffer``: a DTensor laid out as the one it replaces (or
        as its parameter, when the state is shaped like the parameter's shard)."""
        like = current if is_dtensor(current) else (param if is_dtensor(param) and local_data(param).shape == buffer.shape else None)
        device = local_data(current).device if isinstance(current, torch.Tensor) else local_data(param).device
        fresh = buffer.to(device, copy=True)
        return spec_of(like).rebuild(fresh) if like is not None else fresh

    def _place(self, sources: list[tuple[tuple[int, Any], torch.Tensor]]) -> None:
        """``"auto"``: put the buffers on the device while ``room`` says it has room to spare."""
        placement = "cpu"
        if self.room is not None and not self.demoted:
            extra = 0 if self.placement == "device" else sum(s.numel() * s.element_size() for _, s in sources)
            placement = "device" if self.room(extra) else "cpu"
        if placement != self.placement:
            self._buffers.clear()  # reallocated below where they now belong
            self.placement = placement

    def demote(self) -> None:
        """After an out-of-memory error: host buffers for the rest of the run (``"auto"``),
        from the next capture on (a restore may still need the current ones)."""
        self.demoted = True

    def _empty_like(self, source: torch.Tensor) -> torch.Tensor:
        strided = source.layout == torch.strided  # else SGD's sparse momentum (sparse=True embeddings): copy_ sizes it
        layout = {"memory_format": torch.preserve_format} if strided else {}  # a sparse tensor takes no memory format
        if self.placement == "device":
            return torch.empty_like(source, **layout)
        if source.device.type == "cpu":  # "cpu" mode is host memory, also on the simulated device
            with host_memory():
                return torch.empty_like(source, **layout)
        if not strided:
            return torch.empty_like(source, device="cpu")
        return torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=source.device.type == "cuda")

    def _copy_stream(self):
        cuda = next((p.device for p in self._params if p.device.type == "cuda"), None)
        if cuda is None:
            self._stream = None
            return torch.no_grad()
        if self._stream is None or self._stream.device != cuda:
            self._stream = torch.cuda.Stream(cuda)
        self._stream.wait_stream(torch.cuda.current_stream(cuda))
        return _StreamNoGrad(self._stream)


def copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``target.copy_(source, non_blocking=True)`` for every pair, in one ``_foreach_copy_`` call
    per pair of devices rather than hundreds of Python-level copies a step. A list that mixes
    devices (an optimizer's CPU step counters among CUDA moments) would send every pair of it
    down torch's one-by-one path, each a copy of its own; grouped, the CUDA pairs of a group take
    a few fused kernels. One by one on a build without mixed-device foreach copies. An
    out-of-memory error is raised, not retried."""
    groups: dict[tuple[torch.device, torch.device], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for target, source in zip(targets, sources):
        into, out_of = groups.setdefault((target.device, source.device), ([], []))
        into.append(target)
        out_of.append(source)
    for into, out_of in groups.values():
        try:
            torch._foreach_copy_(into, out_of, non_blocking=True)
        except RuntimeError as exc:
            if is_oom_error(exc):
                raise
            for target, source in zip(into, out_of):
                target.copy_(source, non_blocking=True)


class _StreamNoGrad:
    """``torch.cuda.stream(s)`` and ``torch.no_grad()`` together."""

    def __init__(self, stream) -> None:
        self._contexts = (torch.cuda.stream(stream), torch.no_grad())

    def __enter__(self) -> None:
        for context in self._contexts:
            context.__enter__()

    def __exit__(self, *exc: object) -> None:
        for context in reversed(self._contexts):
            context.__exit__(*exc)
