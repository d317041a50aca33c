"""A byte count of a NumPy type (computed from a config: ``np.int64(total * 0.9)``) is a byte count,
stored as a plain ``int``; before, an ``int64`` was refused as "must be a byte count"."""

from __future__ import annotations

import numpy as np
import pytest

from autobatch.memory.units import parse_bytes


@pytest.mark.parametrize("value", [np.int64(2**20), np.uint32(2**20), np.float32(2**20), 2**20])
def test_numpy_counts_are_byte_counts(value):
    parsed = parse_bytes(value, name="memory_limit")
    assert parsed == 2**20 and type(parsed) is int


@pytest.mark.parametrize("value", [True, np.bool_(True)])
def test_a_boolean_is_still_refused(value):
    with pytest.raises(ValueError, match="memory_limit must be a byte count"):
        parse_bytes(value, name="memory_limit")
