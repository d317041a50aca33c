"""Keys a command line sets that the run it describes never reads: one warning line each.

Every command accepts every key (``probe`` and ``train`` share one schema, so a sweep can vary
anything), but not every combination reads them all: without ``train.global_batch`` no plan is
made, so the ``plan`` keys go unread; with ``train.micro_batch`` no probe or plan runs; and
``probe.isolate`` is for ``train`` only. A key the user set and the run ignored looked like it
had been honoured. :func:`ignored_keys` compares the composed config with the packaged defaults
of the command, so only keys the user changed (on the command line or in a config of their own)
are named, never the defaults themselves.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = ["ignored_keys", "changed_keys"]

#: Keys that ``train`` reads even when no probe or plan runs: the memory the run is held to,
#: and the runner's split policy and activation-checkpointing fallback targets.
_TRAIN_READS = {"probe.memory_limit", "plan.balanced", "plan.checkpoint_modules"}


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True, enum_to_str=True) if isinstance(node, DictConfig) else node


def changed_keys(cfg: DictConfig, defaults: DictConfig, group: str) -> list[str]:
    """The keys of ``group`` whose value in ``cfg`` differs from the packaged ``defaults``."""
    mine, packaged = _plain(cfg.get(group)) or {}, _plain(defaults.get(group)) or {}
    return [f"{group}.{key}" for key, value in mine.items() if packaged.get(key, object()) != value]


def _listed(keys: list[str]) -> str:
    return ", ".join(keys) + (" is" if len(keys) == 1 else " are")


def ignored_keys(command: str, cfg: DictConfig, defaults: DictConfig) -> list[str]:
    """One warning line for each group of keys the ``command`` run of ``cfg`` will not read."""
    train, warnings = cfg.train, []
    plan_keys = changed_keys(cfg, defaults, "plan")
    if command == "probe":
        if cfg.probe.get("isolate"):
            warnings.append("probe.isolate is for train only (probe always probes in its own process); it is ignored here")
        if plan_keys and train.global_batch is None:
            warnings.append(f"{_listed(plan_keys)} ignored: no plan is made without train.global_batch "
                            "(add train.global_batch=N to plan N samples a step)")
        return warnings
    if train.resume is not None:
        return warnings  # the checkpoint decides the batches; no probe or plan runs
    if train.micro_batch is not None:
        unread = [k for k in changed_keys(cfg, defaults, "probe") + plan_keys if k not in _TRAIN_READS]
        if unread:
            warnings.append(f"{_listed(unread)} ignored: train.micro_batch={train.micro_batch} trains that micro-batch "
                            "with no probe or plan (drop train.micro_batch to probe)")
        return warnings
    unread = [k for k in plan_keys if k not in _TRAIN_READS]
    if unread and train.global_batch is None:
        warnings.append(f"{_listed(unread)} ignored: no plan is made without train.global_batch "
                        "(add train.global_batch=N to plan N samples a step)")
    return warnings
