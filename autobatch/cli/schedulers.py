"""The ``scheduler`` config group of ``python -m autobatch train``: a learning-rate schedule.

``scheduler=none`` (the default) keeps ``train.lr`` for the whole run. ``scheduler=cosine``,
``scheduler=linear_warmup`` and ``scheduler=step`` are schedules of autobatch's own
(:class:`WarmupCosineLR`, :class:`WarmupLinearLR`, :class:`WarmupStepLR`), each with an optional
linear warm-up of ``scheduler.warmup_steps`` optimizer steps; ``scheduler.total_steps`` (null)
is the run's length, ``train.steps`` or ``train.epochs`` times the batches of an epoch.
``scheduler=target scheduler._target_=torch.optim.lr_scheduler.OneCycleLR +scheduler.max_lr=0.01
+scheduler.total_steps=100`` takes any ``torch.optim.lr_scheduler.LRScheduler`` by import path,
built with the optimizer as its ``optimizer`` argument, like the ``optimizer`` group.

The CLI hands the scheduler to :class:`~autobatch.Runner`, which steps it once after every
applied optimizer step (an OOM's replay and gradient accumulation's micro-batches do not step
it; a step undone is undone with it) and saves and restores it in checkpoints. Each schedule
is a closed form of the step count, so a restored one goes on exactly where it stopped. On
resume the checkpoint's schedule (its ``total_steps``, ``warmup_steps``...) is continued, as
torch's schedulers do; a configured value that differs is named in a warning.
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from omegaconf import MISSING, DictConfig, OmegaConf

__all__ = [
    "SchedulerConfig", "NoSchedulerConfig", "CosineConfig", "LinearWarmupConfig", "StepConfig", "SCHEDULER_SCHEMAS",
    "WarmupCosineLR", "WarmupLinearLR", "WarmupStepLR", "check_scheduler", "build_scheduler", "check_scheduler_kind",
]  # fmt: skip

log = logging.getLogger("autobatch")


# -- schemas (registered with the other groups' by autobatch.cli.config) ------------------
@dataclass
class SchedulerConfig:
    """Any ``torch.optim.lr_scheduler.LRScheduler`` by ``_target_``, built with the optimizer;
    its other arguments with ``+scheduler.x=``."""

    _target_: str = MISSING


@dataclass
class NoSchedulerConfig:
    """``scheduler=none``: the learning rate stays ``train.lr`` (the optimizer's ``lr``)."""


@dataclass
class _WarmupConfig(SchedulerConfig):
    #: Optimizer steps of linear warm-up from ``lr / warmup_steps`` to ``lr`` (0: none).
    warmup_steps: int = 0
    #: Optimizer steps the schedule spans, warm-up included (null: the run's length,
    #: ``train.steps`` or ``train.epochs`` times the batches of an epoch).
    total_steps: Optional[int] = None


@dataclass
class CosineConfig(_WarmupConfig):
    _target_: str = "autobatch.cli.schedulers.WarmupCosineLR"
    #: The learning rate the cosine ends at, after ``total_steps``.
    min_lr: float = 0.0


@dataclass
class LinearWarmupConfig(_WarmupConfig):
    _target_: str = "autobatch.cli.schedulers.WarmupLinearLR"
    #: Optimizer steps of warm-up (null: a tenth of ``total_steps``, at least 1).
    warmup_steps: Optional[int] = None  # type: ignore[assignment]
    #: After the warm-up, decay linearly to ``min_lr`` at ``total_steps`` (false: stay at ``lr``).
    decay: bool = True
    min_lr: float = 0.0


@dataclass
class StepConfig(_WarmupConfig):
    _target_: str = "autobatch.cli.schedulers.WarmupStepLR"
    #: Multiply the learning rate by ``gamma`` every ``step_size`` optimizer steps (after the warm-up).
    step_size: int = 10
    gamma: float = 0.1


SCHEDULER_SCHEMAS: dict[str, type] = {
    "schema_scheduler": SchedulerConfig,
    "schema_scheduler_none": NoSchedulerConfig,
    "schema_scheduler_cosine": CosineConfig,
    "schema_scheduler_linear_warmup": LinearWarmupConfig,
    "schema_scheduler_step": StepConfig,
}


# -- the schedules ------------------------------------------------------------------------
class _WarmupSchedule(torch.optim.lr_scheduler.LRScheduler):
    """A linear warm-up over ``warmup_steps``, then :meth:`_after` of the progress through the
    rest of ``total_steps``; the learning rate is a function of the step count alone, so a
    restored state (``last_epoch``) continues the same curve. Past ``total_steps`` it stays
    at the curve's end."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0,
                 last_epoch: int = -1) -> None:
        self.total_steps, self.warmup_steps = int(total_steps), int(warmup_steps)
        super().__init__(optimizer, last_epoch)

    def _after(self, base: float, progress: float, step: int) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def get_lr(self) -> list[float]:  # type: ignore[override]
        step = max(0, self.last_epoch)
        if step < self.warmup_steps:
            return [base * (step + 1) / self.warmup_steps for base in self.base_lrs]
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return [self._after(base, progress, step) for base in self.base_lrs]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the checkpoint's schedule; warn about each configured value it replaces."""
        changed = [f"{name}={getattr(self, name)} (the checkpoint's: {state_dict[name]})"
                   for name in self._settings() if name in state_dict and state_dict[name] != getattr(self, name)]
        if changed:
            log.warning("resume: the checkpoint's schedule is continued, not scheduler.%s (past its total_steps the "
                        "learning rate stays at the schedule's end); start a new run to change the schedule",
                        ", scheduler.".join(changed))
        super().load_state_dict(state_dict)

    def _settings(self) -> tuple[str, ...]:
        return ("total_steps", "warmup_steps")


class WarmupCosineLR(_WarmupSchedule):
    """Warm-up, then half a cosine from each group's ``lr`` down to ``min_lr`` at ``total_steps``."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0,
                 min_lr: float = 0.0, last_epoch: int = -1) -> None:
        self.min_lr = float(min_lr)
        super().__init__(optimizer, total_steps, warmup_steps, last_epoch)

    def _after(self, base: float, progress: float, step: int) -> float:
        return self.min_lr + (base - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def _settings(self) -> tuple[str, ...]:
        return ("total_steps", "warmup_steps", "min_lr")


class WarmupLinearLR(_WarmupSchedule):
    """Warm-up, then (``decay``) a straight line from ``lr`` down to ``min_lr`` at ``total_steps``."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int | None = None,
                 decay: bool = True, min_lr: float = 0.0, last_epoch: int = -1) -> None:
        self.decay, self.min_lr = bool(decay), float(min_lr)
        warmup = max(1, int(total_steps) // 10) if warmup_steps is None else warmup_steps
        super().__init__(optimizer, total_steps, warmup, last_epoch)

    def _after(self, base: float, progress: float, step: int) -> float:
        return base - (base - self.min_lr) * progress if self.decay else base

    def _settings(self) -> tuple[str, ...]:
        return ("total_steps", "warmup_steps", "decay", "min_lr")


class WarmupStepLR(_WarmupSchedule):
    """Warm-up, then ``lr * gamma ** ((step - warmup_steps) // step_size)`` (torch's ``StepLR``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0,
                 step_size: int = 10, gamma: float = 0.1, last_epoch: int = -1) -> None:
        self.step_size, self.gamma = int(step_size), float(gamma)
        super().__init__(optimizer, total_steps, warmup_steps, last_epoch)

    def _after(self, base: float, progress: float, step: int) -> float:
        return base * self.gamma ** ((step - self.warmup_steps) // self.step_size)

    def _settings(self) -> tuple[str, ...]:
        return ("total_steps", "warmup_steps", "step_size", "gamma")


# -- from the config ----------------------------------------------------------------------
def _run_length(cfg: DictConfig) -> int | None:
    """``train.steps``, when the run's length is known before the data (no ``train.epochs``)."""
    return None if cfg.train.get("epochs") is not None else int(cfg.train.steps)


def check_scheduler(cfg: DictConfig, target: Any = None) -> None:
    """The scheduler's values, before anything is built; ``ValueError`` names the key. ``target``:
    what ``scheduler._target_`` imports (its arguments are checked against its signature by the
    caller); ``ReduceLROnPlateau`` is refused here, before a probe, not when training starts."""
    if isinstance(target, type) and issubclass(target, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError("scheduler._target_=ReduceLROnPlateau needs a metric at each step, and train steps the scheduler "
                         "after every optimizer step with none; choose another (scheduler=cosine, linear_warmup, step) "
                         "or train with autobatch.Runner in Python and step it in on_step_end")
    node = cfg.get("scheduler")
    if not isinstance(node, DictConfig):
        return
    if OmegaConf.get_type(node) not in _BUILT_IN:
        _check_required(node, target)
        return
    _check_values(cfg, node)
    if node.warmup_steps is None:  # linear_warmup: a tenth of the schedule, never all of it
        return
    if node.warmup_steps < 0:
        raise ValueError(f"scheduler.warmup_steps must be >= 0 (0: no warm-up), got {node.warmup_steps}")
    total = node.total_steps if node.total_steps is not None else _run_length(cfg)
    _check_warmup(node.warmup_steps, bool(node.get("decay", True)), total, given=node.total_steps is not None)


def _check_values(cfg: DictConfig, node: DictConfig) -> None:
    """``total_steps``, ``min_lr``, ``step_size`` and ``gamma`` of a built-in schedule."""
    if node.total_steps is not None and node.total_steps < 1:
        raise ValueError(f"scheduler.total_steps must be a positive integer or null (the run's length), got {node.total_steps}")
    lr = float(cfg.optimizer.get("lr", cfg.train.lr))
    if "min_lr" in node and not 0 <= node.min_lr <= lr:
        raise ValueError(f"scheduler.min_lr must be between 0 and the learning rate (optimizer.lr={lr}, from train.lr "
                         f"unless set), got {node.min_lr}")
    if "step_size" in node and node.step_size < 1:
        raise ValueError(f"scheduler.step_size must be a positive number of optimizer steps, got {node.step_size}")
    if "gamma" in node and not 0 < node.gamma <= 1:
        raise ValueError(f"scheduler.gamma must be in (0, 1] (the factor of each decay), got {node.gamma}")


_BUILT_IN = (CosineConfig, LinearWarmupConfig, StepConfig)


def _check_required(node: DictConfig, target: Any) -> None:
    """A ``_target_`` scheduler's required arguments (``ExponentialLR`` 's ``gamma``) must be
    given; before, a missing one failed only when training started, after the probe. Its
    ``total_steps`` (``OneCycleLR``) is the run's length when not given (:func:`build_scheduler`)."""
    try:
        parameters = list(inspect.signature(target).parameters.values())[1:]  # after the optimizer
    except (TypeError, ValueError):
        return
    missing = [p.name for p in parameters if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               and p.name not in node and p.name != "total_steps"]
    if missing:
        raise ValueError(f"scheduler._target_={node._target_} needs {', '.join(missing)}; give "
                         + " ".join(f"+scheduler.{name}=VALUE" for name in missing))


def _check_warmup(warmup: int, decay: bool, total: int | None, *, given: bool) -> None:
    """A warm-up as long as the schedule (or longer) never reaches its decay: refused, naming
    ``scheduler.total_steps`` when ``given``, else the run's length that stands for it."""
    if total is None or warmup < total or (warmup == total and not decay):
        return
    source = "scheduler.total_steps" if given else "the run's length (train.steps, or train.epochs times an epoch's batches)"
    raise ValueError(f"scheduler.warmup_steps={warmup} leaves no step of the schedule after it: {source} is {total}; "
                     f"lower scheduler.warmup_steps or raise {'scheduler.total_steps' if given else 'the run length'}")


def build_scheduler(cfg: DictConfig, optimizer: torch.optim.Optimizer, run_steps: int) -> Any:
    """The configured scheduler of ``optimizer`` (None for ``scheduler=none`` or a config without
    the group); ``run_steps``: the run's length in optimizer steps, the built-ins' ``total_steps``
    when it is null. ``ValueError`` names the key to fix."""
    from .construct import construct

    node = cfg.get("scheduler")
    if not isinstance(node, DictConfig) or "_target_" not in node:
        return None
    args = OmegaConf.to_container(node, resolve=True)
    assert isinstance(args, dict)
    takes_total = "total_steps" in _parameter_names(node)
    if OmegaConf.get_type(node) in _BUILT_IN or (takes_total and not args.get("epochs")):
        if args.get("total_steps") is None:
            args["total_steps"] = run_steps
            if args.get("warmup_steps") is not None:
                _check_warmup(int(args["warmup_steps"]), bool(args.get("decay", True)), run_steps, given=False)
    args, nested = _nested_schedulers(args, optimizer)  # SequentialLR's, ChainedScheduler's, built with the optimizer
    scheduler = construct("scheduler", args, expect=torch.optim.lr_scheduler.LRScheduler, optimizer=optimizer, **nested)
    settings = {name: getattr(scheduler, name) for name in getattr(scheduler, "_settings", tuple)()}
    shown = f"({', '.join(f'{name}={value}' for name, value in settings.items())})" if settings else ""
    log.info("learning-rate schedule: %s%s, stepped once per optimizer step", type(scheduler).__name__, shown)
    return scheduler


def _nested_schedulers(args: dict[str, Any], optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """``args`` less a ``schedulers`` list of nodes with their own ``_target_`` (``SequentialLR``'s and
    ``ChainedScheduler``'s: ``+scheduler.schedulers=[{_target_:torch.optim.lr_scheduler.LinearLR,...},...]``),
    and that list built, each with the optimizer, as the scheduler itself is. Hydra built those nodes
    without it, and the run stopped after its probe on "LinearLR.__init__() missing 1 required positional
    argument: 'optimizer'", advised to give +scheduler.optimizer=VALUE, which no command line can."""
    from .construct import construct

    items = args.get("schedulers")
    if not isinstance(items, list) or not any(isinstance(item, dict) and "_target_" in item for item in items):
        return args, {}
    built = [construct(f"scheduler.schedulers[{index}]", item, expect=torch.optim.lr_scheduler.LRScheduler,
                       optimizer=optimizer) if isinstance(item, dict) and "_target_" in item else item
             for index, item in enumerate(items)]
    return {key: value for key, value in args.items() if key != "schedulers"}, {"schedulers": built}


def _parameter_names(node: DictConfig) -> list[str]:
    """The argument names of what ``node._target_`` imports (none where it has no signature)."""
    from .build import locate

    try:
        return list(inspect.signature(locate(node._target_)).parameters)
    except (ImportError, TypeError, ValueError):
        return []


#: The option that builds each built-in schedule (for a resume of another run's checkpoint).
_OPTIONS = {"WarmupCosineLR": "cosine", "WarmupLinearLR": "linear_warmup", "WarmupStepLR": "step"}


def check_scheduler_kind(state: dict[str, Any], cfg: DictConfig, path: Any) -> None:
    """``ValueError`` naming the ``scheduler`` override to give when ``train.resume`` continues a
    checkpoint written with another schedule than this command builds, ``none`` included. The
    runner refused another class naming only the class (``resume with WarmupCosineLR``) and,
    for a command that left out ``scheduler=cosine``, only warned and trained on at the learning
    rate the schedule had left (0.0 at its end). Checkpoints of versions without the field pass."""
    if "scheduler_type" not in state:
        return
    saved, node = state["scheduler_type"], cfg.get("scheduler")
    target = node.get("_target_") if isinstance(node, DictConfig) else None
    mine = None if target is None else target.rsplit(".", 1)[-1]
    if saved == mine:
        return
    if saved is None:
        give = "scheduler=none"
    elif saved in _OPTIONS:
        give = f"scheduler={_OPTIONS[saved]} (and the scheduler settings of the run it continues)"
    elif isinstance(getattr(torch.optim.lr_scheduler, saved, None), type):
        give = f"scheduler=target scheduler._target_=torch.optim.lr_scheduler.{saved} (and its arguments)"
    else:
        give = f"scheduler._target_ naming the class {saved}"
    raise ValueError(f"train.resume: the checkpoint {path} was trained with scheduler {saved or 'none'} and this run "
                     f"builds {mine or 'none'}; give {give}, or start afresh without train.resume")
