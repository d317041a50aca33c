"""The closed sets of values a command-line config accepts, as ``Enum`` s.

OmegaConf validates an ``Enum`` field (it has no ``Literal``), so ``precision=fp8`` fails with
Hydra's own message listing the choices before any code runs. Used by the schemas in
:mod:`.config`.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["Choice", "Precision", "Strategy", "Objective", "StepGuardKind", "DeviceKind", "InputKind", "DType"]


class Choice(Enum):
    """A choice that reads as its value in text: OmegaConf puts ``str(value)`` into a string
    interpolation, so ``hydra.run.dir=runs/${probe.strategy}_${precision}`` made directories
    named ``Strategy.auto_Precision.fp32``; now ``auto_fp32``, as the user typed them."""

    def __str__(self) -> str:
        return str(self.value)


class Precision(Choice):
    """Training precision: full fp32, or bf16/fp16 autocast (fp16 adds a GradScaler)."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Strategy(Choice):
    """The probe's search strategy (see :func:`autobatch.find_max_batch`)."""

    auto = "auto"
    predict = "predict"
    binary = "binary"
    power = "power"
    halving = "halving"
    estimate = "estimate"


class Objective(Choice):
    """What the planner optimises (see :func:`autobatch.plan`)."""

    max_batch = "max_batch"
    throughput = "throughput"


class StepGuardKind(Choice):
    """How the runner makes an OOM inside ``optimizer.step()`` safe to replay."""

    auto = "auto"
    cpu = "cpu"
    device = "device"
    off = "off"


class DeviceKind(Choice):
    """Where to run: ``auto`` is the GPU if there is one, else the CPU under a simulated budget."""

    auto = "auto"
    cuda = "cuda"
    cpu = "cpu"


class InputKind(Choice):
    """What a model eats: float ``tensor`` s of ``data.shape``, or ``tokens`` of ``data.seq_len``."""

    tensor = "tensor"
    tokens = "tokens"


class DType(Choice):
    """Floating dtype of synthetic tensor inputs."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


# -- model ------------------------------------------------------------------------------
