"""The host's random generators a step may draw from, read and put back around a probe.

torch's own generators are read by :class:`~autobatch.probe.restore.Snapshot`; a ``make_batch``
may also draw from Python's ``random`` or NumPy's global generator, and the probe's trials (and
the cache key's batches) must leave those as they found them too.
"""

from __future__ import annotations

import random
import sys
from typing import Any

__all__ = ["host_rng_states", "set_host_rng_states"]


def host_rng_states() -> tuple[Any, Any]:
    """Python's ``random`` state and NumPy's global one (None where NumPy is not imported: a
    ``make_batch`` that draws from it has imported it)."""
    numpy = sys.modules.get("numpy")
    return random.getstate(), None if numpy is None else numpy.random.get_state()


def set_host_rng_states(states: tuple[Any, Any] | None) -> None:
    """Put back what :func:`host_rng_states` read."""
    if states is None:
        return
    python, numpy_state = states
    random.setstate(python)
    if numpy_state is not None:
        sys.modules["numpy"].random.set_state(numpy_state)
