"""The command line's structured configs: one dataclass per concern, registered with Hydra.

The YAML files in ``conf/`` (shipped as ``autobatch.conf``) fill these schemas in; because
every node is typed, Hydra rejects an unknown key or a value of the wrong type with its own
message before any code runs. Choices are ``Enum`` s (:mod:`.choices`), which OmegaConf validates (it has no
``Literal``). Each field's docstring-comment below says what it does; the README repeats it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, List, Optional, Tuple

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from .schedulers import SCHEDULER_SCHEMAS
from .choices import DeviceKind, DType, InputKind, Objective, Precision, StepGuardKind, Strategy

__all__ = [
    "Precision",
    "Strategy",
    "DeviceKind",
    "InputKind",
    "DType",
    "ModelConfig",
    "MLPConfig",
    "CNNConfig",
    "GPTConfig",
    "DataConfig",
    "OptimizerConfig",
    "AdamWConfig",
    "SGDConfig",
    "Objective",
    "StepGuardKind",
    "ProbeConfig",
    "PlanConfig",
    "TrainConfig",
    "DeviceConfig",
    "ProbeAppConfig",
    "TrainAppConfig",
    "SCHEMAS",
    "register_configs",
]


@dataclass
class ModelConfig:
    """Any ``torch.nn.Module`` by ``_target_``; its keyword arguments are added with ``+model.x=``."""

    _target_: str = MISSING
    #: Which synthetic input the model takes (not passed to the constructor).
    inputs: InputKind = InputKind.tensor
    #: Not a key: the per-sample dimensions a built-in model needs (None: any number).
    INPUT_DIMS: ClassVar[Optional[Tuple[str, ...]]] = None


@dataclass
class MLPConfig(ModelConfig):
    """:class:`autobatch.workloads.models.MLP`: flatten, ``layers`` x Linear(``width``)+ReLU, classifier."""

    _target_: str = "autobatch.workloads.models.MLP"
    #: Per-sample input shape (flattened); defaults to ``data.shape``.
    in_shape: List[int] = MISSING
    #: Output classes; defaults to ``data.num_classes``.
    num_classes: int = MISSING
    #: Hidden width.
    width: int = 256
    #: Hidden layers.
    layers: int = 2


@dataclass
class CNNConfig(ModelConfig):
    """:class:`autobatch.workloads.models.ResNetCNN`: a small ResNet of basic blocks."""

    _target_: str = "autobatch.workloads.models.ResNetCNN"
    INPUT_DIMS: ClassVar[Optional[Tuple[str, ...]]] = ("channels", "height", "width")
    #: Image channels; defaults to ``data.shape[0]``.
    in_channels: int = MISSING
    #: Output classes; defaults to ``data.num_classes``.
    num_classes: int = MISSING
    #: Channels of the first stage (each later stage doubles them).
    width: int = 8
    #: Stages; each after the first halves the resolution.
    stages: int = 3
    #: Basic blocks per stage.
    blocks_per_stage: int = 1


@dataclass
class GPTConfig(ModelConfig):
    """:class:`autobatch.workloads.models.GPT`: a decoder-only transformer."""

    _target_: str = "autobatch.workloads.models.GPT"
    inputs: InputKind = InputKind.tokens
    #: Vocabulary size; defaults to ``data.vocab_size``.
    vocab_size: int = MISSING
    #: Longest sequence; defaults to ``data.seq_len``.
    max_seq_len: int = MISSING
    #: Decoder blocks.
    layers: int = 2
    #: Model width (embedding size).
    width: int = 128
    #: Attention heads (must divide ``width``).
    heads: int = 4
    #: MLP hidden size as a multiple of ``width``.
    mlp_ratio: int = 4
    #: Dropout probability.
    dropout: float = 0.0


# -- data -------------------------------------------------------------------------------
@dataclass
class DataConfig:
    """A synthetic batch spec, or a ``_target_`` dataset under ``dataset``."""

    #: Per-sample shape of tensor inputs (mlp, cnn, ``_target_`` vision models).
    shape: List[int] = field(default_factory=lambda: [3, 32, 32])
    #: dtype of synthetic tensor inputs.
    dtype: DType = DType.float32
    #: Classes of the classification target.
    num_classes: int = 10
    #: Token inputs: the (longest) sequence length.
    seq_len: int = 128
    #: Token inputs: when set, training draws each batch's length from [min_seq_len, seq_len];
    #: the probe always uses ``seq_len``, the worst case.
    min_seq_len: Optional[int] = None
    #: Token vocabulary.
    vocab_size: int = 1024
    #: Samples in one epoch (``train.epochs``) of synthetic data.
    num_samples: int = 1024
    #: A map-style dataset by ``_target_`` (with its arguments) whose samples are
    #: ``(input, target)``; replaces the synthetic spec when set.
    dataset: Optional[Any] = None


# -- optimizer --------------------------------------------------------------------------
@dataclass
class OptimizerConfig:
    """Any ``torch.optim.Optimizer`` by ``_target_``; more arguments with ``+optimizer.x=``."""

    _target_: str = MISSING
    #: Learning rate (``train`` sets it to ``train.lr``).
    lr: float = 1e-3


@dataclass
class AdamWConfig(OptimizerConfig):
    _target_: str = "torch.optim.AdamW"
    weight_decay: float = 0.01
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])


@dataclass
class SGDConfig(OptimizerConfig):
    _target_: str = "torch.optim.SGD"
    momentum: float = 0.9
    weight_decay: float = 0.0


# -- probe, train, device ---------------------------------------------------------------
@dataclass
class ProbeConfig:
    """Arguments of :func:`autobatch.find_max_batch`."""

    #: auto | binary | power | halving.
    strategy: Strategy = Strategy.auto
    #: First batch size tried (null: the strategy's default).
    start: Optional[int] = None
    #: Never try a larger batch (null: no bound).
    max_batch: Optional[int] = None
    #: Fraction taken off the boundary, e.g. 0.05; the result is re-verified.
    margin: float = 0.0
    #: Every size tried, and the answer, is a multiple of this.
    multiple_of: int = 1
    #: Training steps in a full trial (>= 1; 3 puts Adam's lazily created state inside the
    #: peak): the first trial and the answer's trial are full.
    steps_per_trial: int = 3
    #: Training steps in the other trials (>= 1; null: every trial is full).
    search_steps: Optional[int] = 1
    #: Cap memory at this size, e.g. "16GiB" ("what fits on a 16 GiB card?"); CPU: the
    #: simulated budget. Null: the whole GPU, or ``device.simulated_budget`` on the CPU.
    #: ``train`` trains within the same cap.
    memory_limit: Optional[str] = None
    #: Draw memory_curve.png (peak memory per trial, fit, capacity, chosen batch) next to
    #: result.json, and summary.png next to a sweep's summary.csv.
    plot: bool = True
    #: Use the persistent probe cache: an identical earlier probe answers without a trial
    #: (``python -m autobatch cache list|clear`` shows and empties it).
    cache: bool = True
    #: The cache directory (null: ``$AUTOBATCH_CACHE_DIR``, else ``~/.cache/autobatch``).
    cache_dir: Optional[str] = None
    #: ``train`` only: probe in a child process, so training starts in a process no trial ran
    #: in. Null: on CUDA without ``train.global_batch`` and outside ``torchrun``.
    isolate: Optional[bool] = None


@dataclass
class PlanConfig:
    """Arguments of :func:`autobatch.plan`, used when ``train.global_batch`` is set."""

    #: max_batch (largest micro-batch) | throughput (time candidates, pick the most samples/s).
    objective: Objective = Objective.max_batch
    #: May split the global batch into micro-batches (gradient accumulation).
    allow_accumulation: bool = True
    #: May turn on activation checkpointing when batch 1 does not fit (or, without
    #: accumulation, to fit the whole global batch).
    allow_checkpointing: bool = True
    #: Class names of the blocks to checkpoint, e.g. [_DecoderBlock] (empty: repeated children
    #: of nn.Sequential / nn.ModuleList). Also the runner's ``checkpointing_fallback`` targets.
    checkpoint_modules: List[str] = field(default_factory=list)
    #: Balanced micro-batches (sizes differ by at most one) rather than full ones and a
    #: smaller last one.
    balanced: bool = True
    #: throughput: the smallest micro-batch timed (null: the largest that fits // 16).
    min_micro_batch: Optional[int] = None
    #: throughput: also time checkpointed candidates when the plain model runs the batch.
    exhaustive: bool = False
    #: throughput: untimed global steps before each candidate's timed ones, in every round.
    warmup_steps: int = 1
    #: throughput: global steps timed one by one per candidate and round (the median counts).
    timed_steps: int = 5
    #: throughput: interleaved rounds re-timing the leading candidates (0: none).
    retime_rounds: int = 2
    #: throughput: the leaders are the candidates within this fraction of the best (0.1: 10 %).
    retime_within: float = 0.1


@dataclass
class TrainConfig:
    """The training run of ``python -m autobatch train`` (on :class:`autobatch.Runner`).

    ``probe`` reads only ``global_batch`` (to print the plan); it accepts the rest so that the
    same overrides work for both commands."""

    #: Samples per optimizer step (null: the probed batch). Set: ``plan`` keeps it exactly,
    #: with gradient accumulation when it does not fit in one step.
    global_batch: Optional[int] = None
    #: Samples per forward/backward: skip the probe and the plan (null: planned).
    micro_batch: Optional[int] = None
    #: Optimizer steps (ignored when ``epochs`` is set).
    steps: int = 20
    #: Passes over ``data.num_samples`` samples (or the dataset); overrides ``steps``.
    epochs: Optional[int] = None
    #: Learning rate (the optimizer's ``lr`` defaults to it).
    lr: float = 1e-3
    #: Shuffle a ``_target_`` dataset every epoch (synthetic data is random anyway).
    shuffle: bool = True
    #: Checkpoint directory: a relative one is under the run directory, an absolute one is used
    #: as it is (every run then writes the same ``last.pt``); ``last.pt`` is written atomically.
    checkpoint_dir: str = "checkpoints"
    #: Checkpoint every this many steps (0: only at the end).
    checkpoint_every: int = 0
    #: Continue from a checkpoint: a ``last.pt`` file, its directory, a run directory, or
    #: ``latest`` (the run directory's own checkpoint, else the newest at any depth under
    #: ``outputs/train`` and ``multirun/train``).
    resume: Optional[str] = None
    #: Grow-back: OOM-free steps before trying double the micro-batch (0: never grow).
    grow_after: int = 100
    #: Grow-back ceiling (null: the largest batch the probe found, at most the global batch).
    max_micro_batch: Optional[int] = None
    #: An OOM recovery never shrinks the micro-batch below this (e.g. 2 for BatchNorm).
    min_micro_batch: int = 1
    #: cpu | device | off: how an OOM inside ``optimizer.step()`` is made safe to replay.
    step_guard: StepGuardKind = StepGuardKind.auto
    #: When micro-batch 1 runs out of memory, turn on activation checkpointing and replay.
    checkpointing_fallback: bool = False
    #: Clip the global batch's gradient to this total norm before each step (null: no clipping).
    max_grad_norm: Optional[float] = None
    #: Under torchrun: shard the model with FSDP2 (``fully_shard`` on each repeated block and
    #: the root) instead of replicating it; probe, plan and train the sharded model.
    fsdp: bool = False
    #: Call ``empty_cache()`` after every this many steps (null: never).
    empty_cache_every: Optional[int] = None
    #: Call it when reserved - allocated exceeds this, e.g. "2GiB" (null: never).
    empty_cache_threshold: Optional[str] = None
    #: A tqdm progress bar: true, false, or null (when stderr is a terminal).
    progress: Optional[bool] = None
    #: Without a bar, a progress log line every this many steps.
    log_every: int = 10
    #: Testing: raise a real OOM at these ``[step, phase]`` points (step from 0; phase
    #: transfer | forward | backward | optimizer), e.g. ``[[3,backward]]``.
    inject_oom: List[List[Any]] = field(default_factory=list)
    #: Testing: how many arrivals at each point fail (null: every one, so the step gives up).
    inject_oom_times: Optional[int] = 1
    #: Testing, under torchrun: the ranks where ``inject_oom`` strikes, e.g. ``[1]`` (empty:
    #: every rank).
    inject_oom_ranks: List[int] = field(default_factory=list)
    #: Testing: sleep this many seconds after each step (to kill a run mid-way).
    inject_delay: float = 0.0


@dataclass
class DeviceConfig:
    """Where to probe and train."""

    #: auto | cuda | cpu.
    type: DeviceKind = DeviceKind.auto
    #: On the CPU, the simulated memory budget when ``probe.memory_limit`` is null
    #: (null: the library default, a quarter of available RAM, at most 2 GiB).
    simulated_budget: Optional[str] = None
    #: cuDNN autotuning (``cudnn.benchmark``), probe and train alike; in the probe cache key.
    cudnn_benchmark: bool = False
    #: The CUDA caching allocator's expandable segments, probe and train alike; in the probe
    #: cache key. null: on, unless PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF names the
    #: setting (then the environment decides); true / false: on / off whatever it says.
    expandable_segments: Optional[bool] = None


# -- the two apps -----------------------------------------------------------------------
@dataclass
class ProbeAppConfig:
    """``python -m autobatch probe``: find the largest batch that trains (with
    ``train.global_batch``: plan how to train that global batch)."""

    #: Typed by the chosen option (mlp/cnn/gpt); ``_target_`` models take free arguments.
    model: Any = MISSING
    data: DataConfig = MISSING
    #: Typed by the chosen option (adamw/sgd); other optimizers take free arguments.
    optimizer: Any = MISSING
    #: The learning-rate schedule ``train`` steps after each optimizer step (none | cosine |
    #: linear_warmup | step | target; :mod:`autobatch.cli.schedulers`). Null: none.
    scheduler: Any = None
    #: The criterion applied to the model's output and the batch's target (cross_entropy | mse, or
    #: any by ``loss._target_``, its arguments free keys; :mod:`autobatch.cli.loss`). Null: cross-entropy.
    loss: Any = None
    probe: ProbeConfig = MISSING
    #: The global batch (``train.global_batch``) and the other training keys; see TrainConfig.
    train: TrainConfig = MISSING
    plan: PlanConfig = MISSING
    device: DeviceConfig = MISSING
    #: fp32 | bf16 | fp16 (autocast).
    precision: Precision = Precision.fp32
    #: Seed for model initialisation and synthetic data.
    seed: int = 0


@dataclass
class TrainAppConfig(ProbeAppConfig):
    """``python -m autobatch train``: probe or plan (unless ``train.micro_batch``), then train."""


def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore; the YAMLs in ``conf/`` extend them.

    Each group's schemas are stored at the top level as ``schema_<group>[_<option>]``, outside
    the group, so that they are never listed among a group's options (``--help``, "Available
    options"); a group's YAML names its schema with ``- /schema_<group>_<option>@_here_``. The
    apps' schemas are ``probe_schema`` and ``train_schema``. Idempotent: storing again
    replaces the same entries.
    """
    store = ConfigStore.instance()
    store.store(name="probe_schema", node=ProbeAppConfig)
    store.store(name="train_schema", node=TrainAppConfig)
    for name, node in SCHEMAS.items():
        store.store(name=name, node=node)


#: The group schemas by their ConfigStore name (see :func:`register_configs`).
SCHEMAS: dict[str, type] = {
    "schema_model": ModelConfig,
    "schema_model_mlp": MLPConfig,
    "schema_model_cnn": CNNConfig,
    "schema_model_gpt": GPTConfig,
    "schema_data": DataConfig,
    "schema_optimizer": OptimizerConfig,
    "schema_optimizer_adamw": AdamWConfig,
    "schema_optimizer_sgd": SGDConfig,
    "schema_probe": ProbeConfig,
    "schema_plan": PlanConfig,
    "schema_train": TrainConfig,
    "schema_device": DeviceConfig,
    **SCHEDULER_SCHEMAS,
}
