"""Keys a command line sets that the run it describes never reads: one warning line each.

Every command accepts every key (``probe`` and ``train`` share one schema, so a sweep can vary
anything), but not every combination reads them all: without ``train.global_batch`` no plan is
made, so the ``plan`` keys go unread; with ``train.micro_batch`` no probe or plan runs; and
``probe.isolate`` is for ``train`` only. A key the user set and the run ignored looked like it
had been honoured. :func:`ignored_keys` compares the composed config with the packaged defaults
of the command, so only keys the user changed (on the command line or in a config of their own)
are named, never the defaults themselves.

A ``train.*`` key given to ``probe`` on the command line (``probe train.steps=50``) is read by
``train`` only (the probe reads ``train.global_batch``, ``train.fsdp`` and ``train.max_grad_norm``):
:func:`unread_overrides` names it once for the command line, a sweep's ``train.steps=10,20``
included, and leaves the same key in a config of the user's own alone (one config serves both).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = ["ignored_keys", "changed_keys", "unread_overrides"]

#: Keys that ``train`` reads even when no probe or plan runs: the memory the run is held to,
#: and the runner's split policy and activation-checkpointing fallback targets.
_TRAIN_READS = {"probe.memory_limit", "plan.balanced", "plan.checkpoint_modules"}
#: ``train`` keys that ``probe`` reads (the plan's global batch, the sharding and the clipping it measures), and
#: those :func:`_unread_by_probe` names with what ``train`` would do with them.
_PROBE_READS = {"global_batch", "fsdp", "max_grad_norm", "micro_batch", "max_micro_batch", "resume"}


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True, enum_to_str=True) if isinstance(node, DictConfig) else node


def changed_keys(cfg: DictConfig, defaults: DictConfig, group: str) -> list[str]:
    """The keys of ``group`` whose value in ``cfg`` differs from the packaged ``defaults``."""
    mine, packaged = _plain(cfg.get(group)) or {}, _plain(defaults.get(group)) or {}
    return [f"{group}.{key}" for key, value in mine.items() if packaged.get(key, object()) != value]


def _listed(keys: list[str]) -> str:
    return ", ".join(keys) + (" is" if len(keys) == 1 else " are")


def _unread_by_probe(train: DictConfig) -> list[str]:
    """``train`` keys that change which batch ``train`` would use but that ``probe`` does not
    read: without a word, the probe's answer looked like what that ``train`` would do."""
    warnings = []
    if train.micro_batch is not None:
        warnings.append(f"train.micro_batch={train.micro_batch} is ignored by probe, which probes (and plans) anyway; "
                        "train with it would train that micro-batch with no probe or plan")
    if train.max_micro_batch is not None:
        warnings.append(f"train.max_micro_batch={train.max_micro_batch} is ignored by probe (its answer is not capped); "
                        "train would cap a larger probed or planned micro-batch at it")
    if train.resume is not None:
        warnings.append(f"train.resume={train.resume} is ignored by probe; train with it would take the checkpoint's "
                        "batches, with no probe or plan")
    return warnings


def _unread_data_keys(cfg: DictConfig, defaults: DictConfig) -> list[str]:
    """``data.num_samples`` with a ``data.dataset`` (an epoch is one pass over it), and
    ``train.shuffle`` without one (synthetic batches are generated, never drawn)."""
    if cfg.data.get("dataset") is not None:
        changed = "data.num_samples" in changed_keys(cfg, defaults, "data")
        return ["data.num_samples is ignored: an epoch is one pass over data.dataset"] if changed else []
    if "train.shuffle" in changed_keys(cfg, defaults, "train"):
        return ["train.shuffle is ignored: it shuffles a data.dataset, and synthetic batches are generated, not drawn"]
    return []


def _lr_overridden(cfg: DictConfig, defaults: DictConfig) -> list[str]:
    """``train.lr`` beside an ``optimizer.lr`` of its own: the packaged ``optimizer.lr`` is
    ``${train.lr}``, and a value given to it replaces that link, so ``train.lr`` went unread and
    the run trained at ``optimizer.lr`` with no word (``train.lr=0.5 optimizer.lr=0.1``)."""
    node = cfg.get("optimizer")
    lr = OmegaConf.to_container(node, resolve=False).get("lr") if isinstance(node, DictConfig) else None
    if lr is None or (isinstance(lr, str) and "${train.lr}" in lr) or "train.lr" not in changed_keys(cfg, defaults, "train"):
        return []
    return [f"train.lr={cfg.train.lr} is ignored: optimizer.lr={cfg.optimizer.lr} sets the optimizer's learning rate "
            "(give only one of them)"]


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
        return warnings + _unread_by_probe(train)
    warnings += _unread_data_keys(cfg, defaults) + _lr_overridden(cfg, defaults)
    if train.epochs is not None and "train.steps" in changed_keys(cfg, defaults, "train"):
        warnings.append(f"train.steps={train.steps} is ignored: train.epochs={train.epochs} sets the run's length "
                        "(drop train.epochs to train a number of steps)")
    if train.resume is not None:  # the checkpoint decides the batches; no probe or plan runs
        unread = [k for k in changed_keys(cfg, defaults, "probe") + plan_keys if k not in _TRAIN_READS]
        if unread:
            warnings.append(f"{_listed(unread)} ignored: train.resume={train.resume} takes the checkpoint's batches "
                            "with no probe or plan (drop train.resume to probe afresh)")
        return warnings
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


def unread_overrides(command: str, overrides: list[str]) -> list[str]:
    """One line for each ``train.*`` override of the command line that ``probe`` does not read
    (``train.steps=50``): accepted (the schema is shared), it looked like it had been honoured.
    Given the command line's overrides, not each job's, so a sweep of them is named once."""
    if command != "probe":
        return []
    lines = []
    for override in overrides:
        key = override.lstrip("+").split("=", 1)[0]
        if override.startswith("~") or not key.startswith("train.") or key.split(".")[1] in _PROBE_READS:
            continue
        lines.append(f"probe ignores {override.lstrip('+')} (a train setting); it applies to python -m autobatch train")
    return lines
