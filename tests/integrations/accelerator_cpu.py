"""An ``accelerator`` fixture for integration tests: import it into a test module (``from accelerator_cpu import accelerator``)."""

from __future__ import annotations

import pytest


@pytest.fixture
def accelerator():
    """An ``accelerate.Accelerator`` on the CPU, its memory and loader references freed afterwards."""
    accelerate = pytest.importorskip("accelerate")
    made = accelerate.Accelerator(cpu=True)
    yield made
    made.free_memory()
    made.gradient_state.dataloader_references = [None]
