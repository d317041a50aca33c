"""Memory a step keeps from call to call, measured in the answer's own trial.

A step that appends its outputs to a list (``preds.append(logits.detach())`` for an epoch's
metrics), keeps the loss with its graph, or grows a cache passes a probe's trial of three steps
at the boundary, and training at that size runs out of memory some steps later: on the CPU's
simulated device an MLP whose loss kept its logits answered 4662 under 16 MiB, with nothing
said, and ran out of memory at its fifth training step. :class:`HeldGrowth` reads what is
allocated as each step of a trial begins and once it returned (its return value dropped, as the
trial drops it): where both the last step's start and its end hold more than the step before's
start (so not state an optimizer makes in its first or second step, nor the value the step
returned), the answer's note (:func:`held_growth_note`) says by how much, and after how many
steps at that rate the answer runs out of memory.

It also sees what each call returns. A plain callable that returns its loss for the caller to
call ``backward()`` and ``optimizer.step()`` on (``return F.cross_entropy(model(x), y)``) runs
forward only in the trials: its answer (3256 where the whole step fits 2305, an MLP under 4 MiB)
held no gradients and no optimizer state, and nothing said so. Where a call returned a tensor
that requires grad and no optimizer stepped in the trials, :func:`returned_loss_note` says so.

An optimizer made outside ``fn`` over a model ``fn`` makes at each call (``model = MLP()`` inside,
``optimizer = AdamW(outer.parameters())`` outside) steps parameters that never get a gradient: it
creates no state, and the answer (2103, an MLP under AdamW capped at 40 MiB) left out the moments a
run that steps its model holds (1799 trains), with nothing said. Where every optimizer step in a
plain callable's trials found no gradient on the parameters it trains
(:attr:`LazyStateWatch.gradless_steps`), :func:`stepped_nothing_note` says so.

A callable that makes its model and optimizer at each call and steps once frees the optimizer's
state when the call ends: no trial ran a forward pass beside it, as training does from its second
step (2103 answered where a loop that keeps AdamW's state trains 1495, the model counted). Where
every optimizer seen stepped once and made state, :func:`fresh_optimizer_note` says so.

A ``TrainStep`` with an enabled fp16 ``GradScaler`` whose gradients are inf or NaN in every trial
(a ``make_batch`` whose samples hold an inf or a NaN; the trials run at scale 1, so not the scale)
never reaches ``optimizer.step()``: the scaler skips it, no state is made, and the answer (an MLP
under AdamW capped at 60 000 bytes: 37, where 27 trains) holds none. Where such a step's trials
called no optimizer step at all, :func:`skipped_steps_note` says so.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..memory.units import format_bytes
from .content_peaks import drawn_shapes
from .train_step import TrainStep

__all__ = ["HeldGrowth", "held_growth_note", "left_out_notes", "returned_loss_note", "stepped_nothing_note",
           "fresh_optimizer_note", "skipped_steps_note"]

#: Steps a trial must have run to tell growth from lazily made state (made in the first step or two).
MIN_STEPS = 3


class HeldGrowth:
    """``fn`` as a probe's trials call it, with what was allocated as each call began and ended,
    by trial (``trials``: how many trials the runner recorded so far, the index of the running one),
    and, for :mod:`~autobatch.probe.content_peaks`, each call's peak above its start and the
    shapes of the batch a ``TrainStep``'s ``make_batch`` built for it (the runner resets the peak
    just before each call)."""

    def __init__(self, fn: Callable[[int], object], memory: Any) -> None:
        self.fn, self.memory = fn, memory
        self.trials: Callable[[], int] = lambda: 0
        self._calls: dict[int, list[tuple[int, int]]] = {}
        self.steps: dict[int, list[tuple[int, tuple]]] = {}  # by trial: (peak above the start, batch shapes)
        self.returned_graph = False  # a call returned a tensor that requires grad (its loss?)

    def __call__(self, batch_size: int) -> None:
        trial = self.trials()
        before = self.memory.allocated()
        with drawn_shapes(self.fn) as shapes:
            returned = self.fn(batch_size)
        self.returned_graph = self.returned_graph or _requires_grad(returned)
        del returned  # dropped before the count, as the trial drops it
        self._calls.setdefault(trial, []).append((before, self.memory.allocated()))
        self.steps.setdefault(trial, []).append((self.memory.peak() - before, tuple(s for built in shapes for s in built)))

    def per_step(self, index: int, steps: int | None) -> int:
        """Bytes that memory held between steps grew by in each of the last steps of trial
        ``index`` (of ``steps`` steps), 0 where it did not grow in both or too few steps ran."""
        calls = self._calls.get(index, [])[-(steps or 0):]
        if len(calls) < MIN_STEPS:
            return 0
        (started, _), (last, ended) = calls[-2], calls[-1]
        between, within = last - started, ended - last
        return min(between, within) if between > 0 and within > 0 else 0


def held_growth_note(growth: HeldGrowth, records: list, batch_size: int, capacity: int | None) -> str | None:
    """The note on an answer whose own (latest passing) trial held more memory after each step,
    from ``records`` (the runner's, in order); None where it did not."""
    index = next((i for i in range(len(records) - 1, -1, -1)
                  if records[i].batch_size == batch_size and records[i].passed), None)
    per_step = 0 if index is None else growth.per_step(index, records[index].steps)
    if not per_step:
        return None
    record = records[index]
    room = None if capacity is None or record.step_peak_bytes is None else capacity - record.step_peak_bytes
    after = "" if room is None else (f"; at that rate training at {batch_size} runs out of memory after about "
                                     f"{max(0, room) // per_step} more steps")
    return (
        f"memory held between steps grew by {format_bytes(per_step)} in each of the last steps of batch {batch_size}'s "
        f"trial{after}: the step keeps tensors alive from call to call (outputs or losses appended to a list, a hook "
        "that keeps activations, a cache that grows). Keep only what you need (loss.item(), out.detach().cpu()), or "
        "clear it, and probe again."
    )


def _requires_grad(value: object) -> bool:
    """``value`` is a tensor that requires grad, or a tuple, list or dict holding one at its top level."""
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else (value,)
    return any(isinstance(item, torch.Tensor) and item.requires_grad for item in items)


def returned_loss_note(growth: HeldGrowth, steps: int) -> str | None:
    """The note on a step whose calls returned a tensor that requires grad while no optimizer
    stepped in the trials (``steps``: :attr:`LazyStateWatch.steps_seen`); None otherwise."""
    if not growth.returned_graph or steps:
        return None
    return ("fn returned a tensor that requires grad and no optimizer stepped in the trials: where fn returns its loss "
            "for the caller to call backward() and optimizer.step() on, the trials ran forward only, and the answer "
            "holds no gradients or optimizer state, so training at it can run out of memory; run the whole step in fn "
            "(loss.backward(), optimizer.step()), or probe autobatch.TrainStep(model, optimizer, loss_fn, make_batch)")


def stepped_nothing_note(fn: object, watch: Any) -> str | None:
    """The note on a plain callable whose optimizer steps in the trials (``watch``: the probe's
    :class:`~autobatch.memory.lazy_state.LazyStateWatch`) all found no gradient on the parameters
    they train, so made no optimizer state; None otherwise, and for a ``TrainStep`` (whose
    parameters without a gradient :func:`~autobatch.probe.arguments.gradless_note` counts)."""
    if isinstance(fn, TrainStep) or not watch.steps_seen or watch.gradless_steps < watch.steps_seen:
        return None
    return (f"the optimizer stepped no parameter with a gradient in the trials ({watch.steps_seen} steps): the "
            "parameters that got gradients are not the ones it trains (a model made inside fn at each call beside an "
            "optimizer made outside it over another model), so the answer holds no optimizer state (AdamW keeps two "
            "tensors the size of the parameters) and training at it can run out of memory; create the optimizer with "
            "the model: both inside fn, or both outside it, passing restore=(model, optimizer)")


def left_out_notes(fn: object, growth: HeldGrowth, watch: Any) -> list[str | None]:
    """A plain callable's notes on state its trials never held: :func:`returned_loss_note` (no
    optimizer stepped), :func:`stepped_nothing_note` (the steps found no gradient), :func:`fresh_optimizer_note`
    and :func:`skipped_steps_note` (a ``TrainStep``'s grad scaler skipped every step)."""
    return [returned_loss_note(growth, watch.steps_seen), stepped_nothing_note(fn, watch), fresh_optimizer_note(fn, watch),
            skipped_steps_note(fn, growth, watch)]


def skipped_steps_note(fn: object, growth: HeldGrowth, watch: Any) -> str | None:
    """The note on a ``TrainStep`` with an enabled grad scaler whose trials' steps ran and never
    stepped its optimizer (``watch.stepped()``; the estimate's traces step copies of it): the
    scaler found inf or NaN gradients in every one, at scale 1, and skipped it, so the answer
    holds no optimizer state; None otherwise."""
    scaler = getattr(fn, "grad_scaler", None) if isinstance(fn, TrainStep) else None
    calls = sum(len(steps) for steps in growth.steps.values())
    if scaler is None or not scaler.is_enabled() or not calls or any(o is fn.optimizer for o in watch.stepped()):
        return None
    return (f"the grad scaler skipped the optimizer step in every trial ({calls} steps): the gradients were inf or NaN "
            "even at scale 1 (does make_batch build samples holding inf or NaN?), so no step made optimizer state "
            "(AdamW keeps two tensors the size of the parameters), the answer holds none, and training at it can run "
            "out of memory; have make_batch build finite samples (torch.nan_to_num, or real samples without them)")


def fresh_optimizer_note(fn: object, watch: Any) -> str | None:
    """The note on a plain callable that made a new optimizer at each call and stepped it once
    (``watch``: the probe's :class:`~autobatch.memory.lazy_state.LazyStateWatch`; two or more
    optimizers seen, none stepped twice, state made): its state never sat beside a forward pass
    in the trials. None otherwise, and for a ``TrainStep`` (one optimizer, stepped every step)."""
    if isinstance(fn, TrainStep) or watch.optimizers_seen < 2 or watch.stepped_again or not watch.made_state:
        return None
    return (f"each call made a new optimizer and stepped it once ({watch.optimizers_seen} optimizers): its state "
            "(AdamW keeps two tensors the size of the parameters) was freed with the call, so no trial ran a forward "
            "pass beside it, as training does from its second step, and training at the answer can run out of memory; "
            "make the model and optimizer outside fn and pass restore=(model, optimizer), or run several steps per call")
