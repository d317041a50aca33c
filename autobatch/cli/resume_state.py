"""What ``train.resume`` reads from a checkpoint before training, and what it tells the user.

:func:`read_checkpoint` reads the run a checkpoint belongs to (its step, ``RunResult``, its
optimizer's class and settings); :func:`check_steps_left` refuses one that already reached
``train.steps`` / ``train.epochs``. Two checks speak in the command line's keys, where the
runner's own messages speak to a library user:

* :func:`check_optimizer_kind`: a checkpoint written with another optimizer class
  (``optimizer=sgd`` then, resumed with the default ``adamw``) is one line naming the option
  to give (the runner's says ``resume with SGD``);
* :func:`check_same_model`: a model built with other ``model.*`` keys than the checkpoint's run
  (``model.width=32`` resuming a run at 256) is one line naming the keys to give, where the
  runner's names only the tensors whose shapes differ;
* :func:`kept_settings`: a resumed run continues with its checkpoint's optimizer state, its
  learning rate and other settings included (exact resume, as PyTorch's ``load_state_dict``
  does), so ``train.lr=0.1`` on a resume command changes nothing. The runner's warning tells a
  library user to set them after resuming, which the command line cannot do (its advice is
  rewritten, :mod:`autobatch.cli.log_advice`); this note names the keys, the values kept, and is
  in the run's ``notes`` (console and ``train_result.json``);
* :func:`loss_notes`: the loss is no state of the checkpoint, so a resume trains with this
  command's ``loss``; where it differs from the one the run recorded (its ``train_result.json``,
  ``result.json`` or ``.hydra/config.yaml``), a note names both and the override that keeps it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from ..errors import CheckpointError
from ..training.checkpoints.checkpoint_io import RUNNER_FORMAT, load_checkpoint, written_by_torch_save
from ..training.checkpoints.sharded_files import check_sharded_resume
from .loss import DEFAULT_LOSS, loss_node, loss_text
from .run_record import checkpoint_owner, recorded_config
from .schedulers import check_scheduler_kind

__all__ = ["read_checkpoint", "check_steps_left", "check_optimizer_kind", "check_same_model", "kept_settings",
           "micro_batch_notes", "loss_notes"]

#: the packaged ``optimizer`` options, by the class they build
_OPTIONS = {"AdamW": "optimizer=adamw", "SGD": "optimizer=sgd"}


def read_checkpoint(path: Path, sharded: bool = False) -> dict[str, Any]:
    """The run a checkpoint belongs to: its step and ``RunResult`` (global batch, plan, ...),
    its optimizer's class (``optimizer_type``, None in older checkpoints), its scheduler's
    (``scheduler_type``, where the checkpoint records one) and parameter groups'
    settings (``optimizer_groups``, without their parameters). ``sharded`` (``train.fsdp``):
    read this rank's file of the sharded checkpoint ``path`` names; a set written by another
    number of ranks, or the wrong kind, is one clear error."""
    path = check_sharded_resume(path, sharded=sharded)
    _check_torch_file(path)
    state = load_checkpoint(path, expect_format=RUNNER_FORMAT)  # CheckpointError (one line) if not ours
    saved = state.get("optimizer")
    groups = [group for group in (saved.get("param_groups") or []) if isinstance(group, dict)] if isinstance(saved, dict) else []
    model = state.get("model") if not sharded else None  # a rank's shards have no shapes to compare
    shapes = {key: tuple(value.shape) for key, value in model.items() if isinstance(value, torch.Tensor)} \
        if isinstance(model, dict) else {}
    return {"step": state["step"], "epoch": state.get("epoch"), "result": state["result"], "model_shapes": shapes,
            "optimizer_type": state.get("optimizer_type"),
            **({"scheduler_type": state["scheduler_type"]} if "scheduler_type" in state else {}),
            "optimizer_groups": [{k: v for k, v in group.items() if k != "params"} for group in groups]}


def _check_torch_file(path: Path) -> None:
    """``CheckpointError`` when ``path`` is not a file ``torch.save`` wrote (a JSON or text file
    given to ``train.resume``), saying what ``train.resume`` takes."""
    if not written_by_torch_save(path):
        raise CheckpointError(
            path, "it is not an autobatch checkpoint; give train.resume the last.pt that python -m autobatch train "
            "writes (in the run directory's checkpoints/), its directory, the run directory, or latest",
        )


def check_steps_left(train: DictConfig, state: dict[str, Any], path: Path) -> None:
    """``ValueError`` when the checkpoint has already reached the run's end (``train.steps``,
    or ``train.epochs`` when set, count the whole run): resuming would train nothing."""
    epochs = train.epochs
    if epochs is None and state["step"] >= train.steps:
        raise ValueError(
            f"the checkpoint {path} is at step {state['step']} >= train.steps={train.steps} (steps count the whole "
            f"run), so resuming would train nothing; raise train.steps (e.g. train.steps={state['step'] + train.steps})"
        )
    if epochs is not None and state.get("epoch") is not None and state["epoch"] >= epochs:
        raise ValueError(
            f"the checkpoint {path} has done {state['epoch']} epochs >= train.epochs={epochs} (epochs count the whole "
            f"run), so resuming would train nothing; raise train.epochs (e.g. train.epochs={state['epoch'] + epochs})"
        )


def check_optimizer_kind(state: dict[str, Any], optimizer: torch.optim.Optimizer, path: Path,
                         cfg: DictConfig | None = None) -> None:
    """``ValueError`` naming the ``optimizer`` override to give when the checkpoint was written
    with another optimizer class than this run builds (its state cannot be loaded into it); with
    ``cfg``, the ``scheduler`` override likewise (:func:`~autobatch.cli.schedulers.check_scheduler_kind`)."""
    if cfg is not None:
        check_scheduler_kind(state, cfg, path)
    saved, mine = state.get("optimizer_type"), type(optimizer).__qualname__
    if saved is None or saved == mine:
        return
    if saved in _OPTIONS:
        give = _OPTIONS[saved]
    elif isinstance(getattr(torch.optim, saved, None), type):
        give = f"optimizer=target optimizer._target_=torch.optim.{saved}"
    else:
        give = f"optimizer._target_ naming the class {saved}"
    raise ValueError(
        f"train.resume: the checkpoint {path} was trained with optimizer {saved} and this run builds {mine}; "
        f"give {give} (and the optimizer settings of the run it continues), or start afresh without train.resume"
    )


def micro_batch_notes(train: DictConfig, state: dict[str, Any]) -> list[str]:
    """A note when ``train.micro_batch`` differs from the micro-batch the checkpoint resumes at
    (the runner's, after any OOM recovery or grow-back), which a resume keeps. The same value
    is no news: the ``continue with:`` command of a stopped run repeats the run's own
    ``train.micro_batch``, and a note that it "is ignored" read as if the resume had gone wrong."""
    given, saved = train.micro_batch, (state.get("result") or {}).get("micro_batch")
    if given is None or given == saved:
        return []
    return [f"train.micro_batch={given} is ignored on resume: the checkpoint's micro-batch{f' {saved}' if saved else ''} is used"]


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def kept_settings(state: dict[str, Any], optimizer: torch.optim.Optimizer, cfg: DictConfig) -> list[str]:
    """One note when this run's optimizer settings (``train.lr``, ``optimizer.*``) differ from
    those the checkpoint holds, which the resumed run keeps: naming each key, the value kept and
    this run's (nothing when they agree, or for a checkpoint of another optimizer class)."""
    if state.get("optimizer_type") not in (None, type(optimizer).__qualname__):
        return []
    changed: dict[str, str] = {}
    saved = map(_configured, state.get("optimizer_groups") or [])
    for group, old in zip(map(_configured, optimizer.param_groups), saved):
        for key, value in group.items():
            if key == "params" or key not in old or not isinstance(value, (int, float, str, bool, tuple, type(None))):
                continue
            if _plain(old[key]) != _plain(value):
                name = "train.lr" if key == "lr" and "lr" not in _given_optimizer_keys(cfg) else f"optimizer.{key}"
                changed.setdefault(name, f"{name} {_plain(old[key])!r} (this run: {_plain(value)!r})")
    if not changed:
        return []
    return [f"kept the checkpoint's optimizer settings: {', '.join(changed.values())}; a resumed run continues its "
            "optimizer's saved state exactly, so the command line does not change them (start afresh without "
            "train.resume to train with others)"]


def _configured(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's settings as configured: a scheduler's group holds the scheduled ``lr``
    (0 at a cosine's end) and the configured one as ``initial_lr``, which is the one compared."""
    if "initial_lr" not in group:
        return group
    return {**{k: v for k, v in group.items() if k != "initial_lr"}, "lr": group["initial_lr"]}


def _given_optimizer_keys(cfg: DictConfig) -> set[str]:
    """The ``optimizer`` keys set to a value of their own, not interpolated from ``train``
    (``optimizer.lr=0.1`` rather than the packaged ``${train.lr}``)."""
    node = cfg.get("optimizer")
    if node is None:
        return set()
    raw = OmegaConf.to_container(node, resolve=False)
    return {key for key, value in raw.items() if not (isinstance(value, str) and value.startswith("${train."))}


#: Where a run records the config it last trained with, in the order read (:func:`loss_notes`).
_LAST_TRAINED = ("train_result.json", "result.json", ".hydra/config.yaml")
#: The packaged ``loss`` options, by the node they compose to.
_LOSS_OPTIONS = {"torch.nn.CrossEntropyLoss": "loss=cross_entropy", "torch.nn.MSELoss": "loss=mse"}


def loss_notes(cfg: DictConfig, checkpoint: Path, run_dir: Path | None) -> list[str]:
    """A note when this run's ``loss`` differs from the one the checkpoint's run recorded (in
    ``run_dir``, the run's own directory continued, else in the checkpoint's run directory): the
    resumed steps train with this command's, which the note names with the override that keeps the
    run's. A run recorded without a ``loss`` key trained with cross-entropy; none recorded: no note."""
    run = run_dir if run_dir is not None else checkpoint_owner(checkpoint, str(cfg.train.checkpoint_dir))
    recorded = recorded_config(run, _LAST_TRAINED) if run is not None else None
    if recorded is None:
        return []
    then = recorded.get("loss") if isinstance(recorded.get("loss"), dict) else dict(DEFAULT_LOSS)
    now = loss_node(cfg)
    if now == then:
        return []
    arguments = " ".join(f"+loss.{key}={value}" for key, value in then.items() if key != "_target_")
    option = _LOSS_OPTIONS.get(str(then.get("_target_")), f"loss._target_={then.get('_target_')}")
    return [f"the loss is {loss_text(now)}, and the run this checkpoint continues trained with {loss_text(then)}: "
            f"the resumed steps train with this run's (a loss is no state of the checkpoint); give {option}"
            f"{' ' + arguments if arguments else ''} to continue with the run's own"]


def check_same_model(cfg: DictConfig, state: dict[str, Any], model: torch.nn.Module, path: Path,
                     run_dir: Path | None) -> None:
    """``ValueError`` naming the ``model.*`` overrides to give when this run's model does not fit the
    checkpoint's weights (other shapes or parameters) and its ``model`` keys differ from those the
    checkpoint's run recorded (in ``run_dir``, the run continued in place, else in the checkpoint's run
    directory). Where the weights fit, or no differing key is recorded, the runner's own check stands."""
    saved = state.get("model_shapes") or {}
    mine = {key: tuple(value.shape) for key, value in model.state_dict().items() if isinstance(value, torch.Tensor)}
    common = saved.keys() & mine.keys()  # none: another wrapping (a compiled model's prefix), left to the runner
    if not common or (saved.keys() == mine.keys() and all(saved[key] == mine[key] for key in common)):
        return
    run = run_dir if run_dir is not None else checkpoint_owner(path, str(cfg.train.checkpoint_dir))
    then = (recorded_config(run, _LAST_TRAINED) or {}).get("model") if run is not None else None
    now = OmegaConf.to_container(cfg.model, resolve=True, enum_to_str=True) if cfg.get("model") is not None else None
    if not isinstance(then, dict) or not isinstance(now, dict) or then.get("_target_") != now.get("_target_"):
        return  # another class: the runner's message (or the recorded config unreadable)
    changed = [key for key in dict.fromkeys([*then, *now]) if then.get(key) != now.get(key)
               and not (isinstance(then.get(key), str) and "${" in then[key])]  # an unresolved record
    if not changed:
        return
    give = " ".join(f"~model.{key}" if key not in then else f"'model.{key}={_override_value(then[key])}'"
                    if isinstance(then[key], (list, dict)) else f"model.{key}={_override_value(then[key])}"
                    for key in changed)
    shown = ", ".join(f"model.{key}={_override_value(now.get(key))} (the run's: {_override_value(then.get(key))})"
                      for key in changed)
    differ = sorted(key for key in common if saved[key] != mine[key])[:3] or sorted(saved.keys() ^ mine.keys())[:3]
    raise ValueError(
        f"train.resume: this run builds another model than the one the checkpoint {path} holds ({shown}; "
        f"{', '.join(differ)} differ); give {give} to continue it, or start afresh without train.resume"
    )


def _override_value(value: Any) -> str:
    """A recorded config value as an override's value (``null``, ``true``, ``[64, 64]``, text as it is)."""
    return value if isinstance(value, str) else json.dumps(value).replace('"', "")
