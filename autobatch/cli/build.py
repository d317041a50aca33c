"""Turn a composed config into the objects a probe or a training run needs.

``validate(cfg)`` checks what the schemas cannot (probe bounds, importable ``_target_`` s,
data that suits the model) and raises ``ValueError`` naming the key to fix, before anything
is built. ``build_workload(cfg)`` then makes the device, model, optimizer, batch makers and
the :class:`~autobatch.TrainStep` the probe runs.
"""

from __future__ import annotations

import importlib
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..dist import agreement as dist_sync
from ..workloads.batches import DatasetBatches, SyntheticBatches
from ..training.oom.faults import PHASES
from ..probe.find import validate_probe_args
from ..planning.plan_arguments import validate_timing
from ..probe.train_step import TrainStep
from . import validation
from .construct import construct
from .dataset_shapes import check_sample_shapes
from .optimizer_fit import check_optimizer_gradients, check_optimizer_target
from .schedulers import check_scheduler
from .target_text import target_form_error
from .loss import build_loss, check_loss, cross_entropy_loss
from .import_path import locate  # kept importable from here: dict_target, override_hints, schedulers
from .ranks import data_parallel
from ..memory.allocator import environment_expandable_segments, set_expandable_segments
from ..memory.devices import memory_for
from ..memory.units import format_bytes, parse_bytes

__all__ = [
    "Workload",
    "validate",
    "select_device",
    "device_kind",
    "memory_limit",
    "training_memory",
    "build_workload",
    "synthetic_spec",
    "cross_entropy_loss",
    "locate",
    "MIN_MEMORY_LIMIT",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
#: The smallest ``probe.memory_limit`` (and ``device.simulated_budget``) taken: 1 KiB. Below it
#: nothing but a few scalars fits (the probe failed with a raw out-of-memory error building the
#: model); a bare number is bytes, so ``probe.memory_limit=1.5`` is a missing unit. Small limits
#: above it stay allowed: 64 KiB rehearses "no batch size fits" with a tiny model.
MIN_MEMORY_LIMIT = 1 << 10


def _name(value: Any) -> str:
    """An Enum member's name, or the value itself as a string."""
    return getattr(value, "name", None) or str(value)


#: An example ``_target_`` for each key that takes one (for "is not set" messages).
_TARGET_EXAMPLES = {
    "model": "torchvision.models.resnet18",
    "optimizer": "torch.optim.SGD",
    "data.dataset": "my_project.data.MyDataset",
    "scheduler": "torch.optim.lr_scheduler.ExponentialLR",
    "loss": "torch.nn.MSELoss",
}


def _check_target(key: str, node: Any) -> Any:
    """The object ``node._target_`` names; ``ValueError`` unless it is set, importable and callable."""
    target = node.get("_target_") if isinstance(node, DictConfig) else None
    if not target:
        example = _TARGET_EXAMPLES.get(key, "my_project.Thing")
        raise ValueError(f"{key}._target_ is not set; give an import path such as {key}._target_={example}")
    if (form := target_form_error(key, target)) is not None:  # quoted, a colon, a call: say what to type
        raise ValueError(form)
    try:
        found = locate(target)
    except ImportError as exc:
        cause = exc.__cause__
        fix = ("fix the import path or install the package that provides it" if cause is None
               else f"install the package that provides {cause.name!r}, or fix that import"
               if isinstance(cause, ModuleNotFoundError) and cause.name else "fix that module (or its installation)")
        # from the module's own error (if any): AUTOBATCH_TRACEBACK=1 shows where it raised
        raise ValueError(f"{key}._target_={target!r} cannot be imported ({exc}); {fix}") from exc.__cause__
    if not callable(found):  # a module or a constant: Hydra's "Expected a callable target" named no key
        kind = "a module" if isinstance(found, type(importlib)) else f"a {type(found).__name__}, not a class or function"
        raise ValueError(f"{key}._target_={target!r} names {kind}; give the class (or function) that builds the "
                         f"{key}, e.g. {key}._target_={_TARGET_EXAMPLES.get(key, 'my_project.Thing')}")
    return found


def validate(cfg: DictConfig) -> None:
    """Check the composed config beyond its types; ``ValueError`` names the key to fix."""
    probe = cfg.probe
    try:
        validate_probe_args(
            start=probe.start,
            max_batch=probe.max_batch,
            strategy=_name(probe.strategy),
            margin=probe.margin,
            multiple_of=probe.multiple_of,
            steps_per_trial=probe.steps_per_trial,
            search_steps=probe.search_steps,
        )
    except ValueError as exc:
        if isinstance(exc, OmegaConfBaseException):  # reading a key failed (an interpolation): the edge names it
            raise
        message = str(exc)
        for name in ("start", "max_batch", "strategy", "margin", "multiple_of", "steps_per_trial", "search_steps"):
            message = message.replace(f"{name}=", f"probe.{name}=").replace(f"{name} must", f"probe.{name} must")
        raise ValueError(message.replace(" or None", " or null")) from None
    if "plan" in cfg:
        _validate_plan(cfg.plan)
    for key in ("probe.memory_limit", "device.simulated_budget"):
        value = OmegaConf.select(cfg, key)
        if value is not None and parse_bytes(value, name=key) < MIN_MEMORY_LIMIT:
            raise ValueError(
                f"{key}={value} is {format_bytes(parse_bytes(value))}, too little to hold any model and batch; give at "
                f"least {format_bytes(MIN_MEMORY_LIMIT)}, with a unit: e.g. {key}=256MiB (a bare number is bytes)"
            )
    validation.check_unknown_keys(cfg)
    validation.check_missing(cfg)
    validation.check_sizes(cfg)
    validation.check_cache_dir(cfg, Path(HydraConfig.get().runtime.cwd) if HydraConfig.initialized() else None)
    validation.check_target_arguments("model", cfg.model, _check_target("model", cfg.model), own=("inputs",))
    check_optimizer_target(cfg.optimizer, optimizer := _check_target("optimizer", cfg.optimizer))  # LBFGS: before its keys
    validation.check_target_arguments("optimizer", cfg.optimizer, optimizer)
    if _has_scheduler(cfg):
        scheduler = _check_target("scheduler", cfg.scheduler)
        validation.check_target_arguments("scheduler", cfg.scheduler, scheduler)
        check_scheduler(cfg, scheduler)
    check_loss(cfg, _check_target)
    if cfg.data.dataset is not None:
        validation.check_target_arguments("data.dataset", cfg.data.dataset, _check_target("data.dataset", cfg.data.dataset))
    inputs = _name(cfg.model.get("inputs", "tensor"))
    if inputs not in ("tensor", "tokens"):
        raise ValueError(f"model.inputs must be 'tensor' or 'tokens', got {inputs!r}")
    validation.check_input_shape(cfg)
    if "train" in cfg:
        _validate_train(cfg.train)


def _has_scheduler(cfg: DictConfig) -> bool:
    """Whether ``cfg`` names a scheduler (not ``scheduler=none``, nor a config without the group)."""
    return isinstance(cfg.get("scheduler"), DictConfig) and "_target_" in cfg.scheduler


def _validate_plan(plan: DictConfig) -> None:
    """The plan's timing knobs (throughput objective); ``ValueError`` names the key to fix."""
    if plan.min_micro_batch is not None and plan.min_micro_batch < 1:
        raise ValueError(f"plan.min_micro_batch must be a positive integer or null, got {plan.min_micro_batch}")
    names = ("warmup_steps", "timed_steps", "retime_rounds", "retime_within")
    try:
        validate_timing(**{name: plan[name] for name in names})
    except ValueError as exc:
        message = str(exc)
        for name in names:
            message = message.replace(f"{name} must", f"plan.{name} must")
        raise ValueError(message) from None


def _validate_train(train: DictConfig) -> None:
    """The ``train`` keys the schema cannot judge; ``ValueError`` names the key to fix."""
    for key in ("global_batch", "micro_batch", "epochs", "max_micro_batch", "min_micro_batch", "empty_cache_every",
                "inject_oom_times"):
        value = train[key]
        if value is not None and value < 1:
            raise ValueError(f"train.{key} must be a positive integer or null, got {value}")
    _check_micro_within_global(train)
    validation.check_micro_bounds(train)
    for key, low, meaning in (
        ("steps", 1, ""),
        ("checkpoint_every", 0, " (0: only at the end)"),
        ("grow_after", 0, " (0: never grow)"),
        ("log_every", 0, " (0: no progress lines)"),
        ("inject_delay", 0, ""),
    ):
        if train[key] < low:
            raise ValueError(f"train.{key} must be >= {low}{meaning}, got {train[key]}")
    if train.get("max_grad_norm") is not None and not 0 < train.max_grad_norm < float("inf"):
        raise ValueError(f"train.max_grad_norm must be a positive number or null, got {train.max_grad_norm}")
    if train.empty_cache_threshold is not None:
        parse_bytes(train.empty_cache_threshold, name="train.empty_cache_threshold")
    if any(rank < 0 for rank in train.inject_oom_ranks):
        raise ValueError(f"train.inject_oom_ranks entries must be ranks >= 0, got {list(train.inject_oom_ranks)}")
    for point in train.inject_oom:
        step, phase = list(point) if len(point) == 2 else (None, None)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0 or phase not in PHASES:
            raise ValueError(
                f"train.inject_oom entries must be [step, phase] with step >= 0 and phase one of "
                f"{', '.join(PHASES)}; got {list(point)}, e.g. train.inject_oom=[[3,backward]]"
            )


def _check_micro_within_global(train: DictConfig) -> None:
    """``train.micro_batch`` is a part of each rank's share of ``train.global_batch``: a larger
    one was silently cut down to the share while the run's notes still named it. Under a
    launcher (``WORLD_SIZE`` ranks) the share is ``global_batch / WORLD_SIZE``."""
    if train.micro_batch is None or train.global_batch is None:
        return
    world = max(1, int(os.environ.get("WORLD_SIZE") or 1))
    share = train.global_batch // world
    if train.micro_batch > share:
        ranks = f" ({world} ranks: {share} samples a rank)" if world > 1 else ""
        raise ValueError(
            f"train.micro_batch={train.micro_batch} is larger than train.global_batch={train.global_batch}{ranks}; a "
            f"micro-batch is a part of the global batch: lower train.micro_batch or raise train.global_batch"
        )


def device_kind(cfg: DictConfig) -> str:
    """``"cuda"`` or ``"cpu"``: ``device.type``, ``auto`` being CUDA when available. Reads no
    device property, so no CUDA context is made."""
    kind = _name(cfg.device.type)
    return "cuda" if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()) else "cpu"


def select_device(cfg: DictConfig) -> torch.device:
    """``device.type``: ``auto`` is CUDA when available, else the CPU."""
    if device_kind(cfg) == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device=cuda but no CUDA device is available; use device=auto or device=cpu")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def configure_allocator(cfg: DictConfig, device: torch.device) -> bool | None:
    """``device.expandable_segments`` on a CUDA device: null turns them on unless the
    environment's allocator settings name them; what was set (None: nothing, the environment
    or the CPU decides). On by default because with fixed segments a size at the edge of memory
    trains only while a new process's first step happens to leave its free pieces where the next
    large request fits (:mod:`autobatch.memory.allocator`), and the command line probes in one
    process and trains in another."""
    if device.type != "cuda":
        return None
    wanted = cfg.device.get("expandable_segments")
    if wanted is None:
        if environment_expandable_segments() is not None:
            return None
        wanted = True
    set_expandable_segments(bool(wanted))
    return bool(wanted)


def memory_limit(cfg: DictConfig, device: torch.device) -> str | None:
    """The probe's memory limit: ``probe.memory_limit``, else on the CPU ``device.simulated_budget``."""
    if cfg.probe.memory_limit is not None:
        return str(cfg.probe.memory_limit)
    if device.type == "cpu" and cfg.device.simulated_budget is not None:
        return str(cfg.device.simulated_budget)
    return None


@contextmanager
def training_memory(cfg: DictConfig, device: torch.device, *, probed: bool = True) -> Iterator[str | None]:
    """Train within the memory the probe was given (:func:`memory_limit`): on a GPU the process is
    capped as the probe's trials were, on the CPU the run counts against the same simulated
    budget. Without it the answer of a capped probe would be trained on the whole device, where
    it cannot run out of memory, and ``probe.memory_limit`` would not be the question the user
    asked ("what trains on a 16 GiB card?"). Yields a note saying so (None: no limit); without
    ``probed`` (``train.micro_batch``, ``train.resume``: no probe ran) it names only the limit."""
    limit = memory_limit(cfg, device)
    if limit is None:
        yield None
        return
    limit_bytes = parse_bytes(limit)
    with memory_for(device, limit_bytes):
        source = "probe.memory_limit" if cfg.probe.memory_limit is not None else "device.simulated_budget"
        if not probed:
            simulated = ", the CPU's simulated budget" if device.type == "cpu" else ""
            yield f"trained within {format_bytes(limit_bytes)} ({source}){simulated}"
        else:
            yield f"trained within {format_bytes(limit_bytes)} ({source}), the memory the probe was given"


@dataclass
class Workload:
    """Everything built from a config: ``probe_step`` runs worst-case batches,
    ``make_batch`` batches like those training sees (the runner's data comes from
    :mod:`autobatch.cli.data`)."""

    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    make_batch: Callable[[int], Any]
    probe_step: TrainStep
    autocast_dtype: torch.dtype | None
    grad_scaler: "torch.amp.GradScaler | None"
    samples_per_epoch: int
    #: The ``data.dataset`` object (None for synthetic data).
    dataset: Any = None


def synthetic_spec(cfg: DictConfig, device: torch.device | str) -> dict[str, Any]:
    """:class:`SyntheticBatches` arguments for the config's ``data`` on ``device``."""
    data = cfg.data
    return dict(
        inputs=_name(cfg.model.get("inputs", "tensor")),
        shape=list(data.shape),
        dtype=_DTYPES[_name(data.dtype)],
        num_classes=data.num_classes,
        seq_len=data.seq_len,
        min_seq_len=data.min_seq_len,
        vocab_size=data.vocab_size,
        device=device,
        seed=cfg.seed,
    )


def _batch_makers(cfg: DictConfig, device: torch.device) -> tuple[Callable, Callable, int, Any]:
    """(training batches, probe batches, samples per epoch, the ``_target_`` dataset or None)."""
    data = cfg.data
    if data.dataset is not None:
        dataset = construct("data.dataset", data.dataset)
        batches = DatasetBatches(dataset, device)
        return batches, DatasetBatches(dataset, device), len(batches), dataset
    spec = synthetic_spec(cfg, device)
    return SyntheticBatches(**spec), SyntheticBatches(**spec, worst_case=True), data.num_samples, None


def build_workload(cfg: DictConfig) -> Workload:
    """Validate ``cfg``, then build the model (on the device), optimizer and batch makers."""
    validate(cfg)
    device = select_device(cfg)
    configure_allocator(cfg, device)  # before the model moves: segments keep the kind they were made with
    torch.backends.cudnn.benchmark = bool(cfg.device.get("cudnn_benchmark", False))
    torch.manual_seed(cfg.seed)
    model_args = OmegaConf.to_container(cfg.model, resolve=True, enum_to_str=True)
    assert isinstance(model_args, dict)
    model_args.pop("inputs", None)
    model = construct("model", model_args, expect=torch.nn.Module).to(device)
    validation.check_checkpoint_modules(cfg, model)
    if cfg.train.get("fsdp"):  # before the optimizer: it must hold the sharded parameters
        from ..dist.fsdp import shard_model

        model = shard_model(model)
    optimizer = construct("optimizer", cfg.optimizer, expect=torch.optim.Optimizer, params=model.parameters())
    check_optimizer_gradients(cfg.optimizer, optimizer, model)  # SparseAdam on dense gradients
    if not cfg.train.get("fsdp"):  # FSDP2 shards instead of replicating: never also DDP
        model = data_parallel(model, device)  # DDP under torchrun: trained and probed through DDP
    make_batch, probe_batch, samples, dataset = _batch_makers(cfg, device)
    first_input = None
    if dataset is not None:
        first_input = validation.check_dataset_inputs(cfg, dataset)
        check_sample_shapes(cfg, dataset)  # variable lengths: default_collate stacks one shape
        validation.check_dataset_size(cfg, len(dataset), dist_sync.world_size())
    autocast_dtype = _AUTOCAST[_name(cfg.precision)]
    validation.check_data_dtype(cfg, model, autocast_dtype, first_input)
    scaler = None
    if autocast_dtype is torch.float16:  # fp16 trains with a GradScaler (CUDA and, since torch 2.3, the CPU)
        scaler = torch.amp.GradScaler(device.type)
    step = TrainStep(  # clipped as training clips, so the probe measures the step that trains
        model, optimizer, build_loss(cfg, device), probe_batch, autocast_dtype=autocast_dtype, grad_scaler=scaler,
        max_grad_norm=cfg.train.get("max_grad_norm"),
    )
    return Workload(device, model, optimizer, make_batch, step, autocast_dtype, scaler, samples, dataset)
