"""autobatch: make PyTorch training survive GPU memory limits.

The library imports and works without Hydra; Hydra lives in the CLI (``python -m autobatch``).
"""

from .errors import NoBatchFitsError
from .memory.oom import free_memory, is_oom_error
from .probe.find import find_max_batch
from .probe.result import ProbeResult
from .memory.simulated import SimulatedMemory, simulated_memory
from .probe.train_step import TrainStep
from .probe.trial import TrialRecord
from .memory.units import format_bytes, parse_bytes

from .version import __version__

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
    "__version__",
]

# Planning: gradient accumulation, activation checkpointing, the fastest plan (issue 5).
from .planning.accumulation import accumulate_gradients, accumulated_step, batch_size_of, micro_batch_sizes, split_batch
from .planning.checkpointing import CheckpointHandle, enable_checkpointing
from .errors import GlobalBatchTooLargeError
from .planning.planner import Plan, plan

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
from .errors import AccumulationBrokenError, CheckpointError, StepOutOfMemoryError
from .training.oom.faults import FaultInjector, inject_oom
from .training.run_result import RunResult
from .training.runner import Runner
from .training.train_call import train

__all__ += [
    "Runner",
    "RunResult",
    "train",
    "FaultInjector",
    "inject_oom",
    "StepOutOfMemoryError",
    "CheckpointError",
    "AccumulationBrokenError",
]

# Know before you run: zero-OOM estimates and the persistent probe cache (issue 8).
from .probe.caching import cache
from .probe.tracing.estimate import BatchEstimate, EstimateError, MemoryEstimate, estimate_max_batch, estimate_memory, estimate_peak

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
from .report.plots import plot_probe, plot_sweep

__all__ += ["plot_probe", "plot_sweep"]

# Many GPUs: ranks agree under torch.distributed (issue 7).
from .dist import agreement as distributed
from .errors import PeerFailedError, PeerOutOfMemoryError, RankDisagreementError, UnevenDataError

__all__ += ["distributed", "RankDisagreementError", "PeerOutOfMemoryError", "PeerFailedError", "UnevenDataError"]

# Where users train: Accelerate's decorator, measured (issue 19). The Lightning and Transformers
# integrations live in autobatch.integrations.lightning / .transformers (their packages are optional).
from .integrations.decorator import find_executable_batch_size

__all__ += ["find_executable_batch_size"]
