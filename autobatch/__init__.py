"""autobatch: make PyTorch training survive GPU memory limits.

The library imports and works without Hydra; Hydra lives in the CLI (``python -m autobatch``).
"""

from .errors import NoBatchFitsError
from .oom import free_memory, is_oom_error
from .probe import find_max_batch
from .result import ProbeResult
from .simulated import SimulatedMemory, simulated_memory
from .train_step import TrainStep
from .trial import TrialRecord
from .units import format_bytes, parse_bytes

__version__ = "0.1.0"

__all__ = [
    "find_max_batch",
    "ProbeResult",
    "TrialRecord",
    "TrainStep",
    "NoBatchFitsError",
    "is_oom_error",
    "free_memory",
    "simulated_memory",
    "SimulatedMemory",
    "parse_bytes",
    "format_bytes",
]

# Planning: gradient accumulation, activation checkpointing, the fastest plan (issue 5).
from .accumulation import accumulate_gradients, accumulated_step, batch_size_of, micro_batch_sizes, split_batch
from .checkpointing import CheckpointHandle, enable_checkpointing
from .errors import GlobalBatchTooLargeError
from .planner import Plan, plan

__all__ += [
    "plan",
    "Plan",
    "split_batch",
    "micro_batch_sizes",
    "batch_size_of",
    "accumulate_gradients",
    "accumulated_step",
    "enable_checkpointing",
    "CheckpointHandle",
    "GlobalBatchTooLargeError",
]

# Resilient training: the OOM-surviving runner, fault injection (issue 6).
from .errors import StepOutOfMemoryError
from .faults import FaultInjector, inject_oom
from .run_result import RunResult
from .runner import Runner, train

__all__ += [
    "Runner",
    "RunResult",
    "train",
    "FaultInjector",
    "inject_oom",
    "StepOutOfMemoryError",
]

# Know before you run: zero-OOM estimates and the persistent probe cache (issue 8).
from . import cache
from .estimate import BatchEstimate, EstimateError, MemoryEstimate, estimate_max_batch, estimate_memory, estimate_peak

__all__ += [
    "cache",
    "estimate_memory",
    "estimate_peak",
    "estimate_max_batch",
    "MemoryEstimate",
    "BatchEstimate",
    "EstimateError",
]

# Reports: the memory-curve and sweep plots (matplotlib is imported only when drawing; issue 9).
from .report import plot_probe, plot_sweep

__all__ += ["plot_probe", "plot_sweep"]

# Many GPUs: ranks agree under torch.distributed (issue 7).
from . import distributed
from .errors import PeerFailedError, PeerOutOfMemoryError, RankDisagreementError

__all__ += ["distributed", "RankDisagreementError", "PeerOutOfMemoryError", "PeerFailedError"]
