"""Review 15: a choice (``probe.strategy``, ``precision``...) put into text reads as its value.

OmegaConf writes ``str(value)`` into a string interpolation, and the choices are ``Enum`` s, so
``hydra.run.dir=runs/${probe.strategy}_${precision}`` named the run ``Strategy.auto_Precision.fp32``.
"""

from __future__ import annotations

from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

import autobatch.cli  # noqa: F401 - registers the schemas, makes autobatch.conf importable


def test_a_run_directory_named_after_choices_reads_as_the_values_typed():
    with initialize_config_module("autobatch.conf", version_base="1.3"):
        cfg = compose("train", overrides=["precision=bf16", "hydra.run.dir=runs/${probe.strategy}_${precision}_${train.step_guard}"],
                      return_hydra_config=True)
    assert OmegaConf.select(cfg, "hydra.run.dir") == "runs/auto_bf16_auto"
