"""The sample batches the probe cache's key describes: ``make_batch(1)`` and ``make_batch(2)``
built with fake tensors, so reading the key allocates nothing and leaves nothing changed
(:mod:`~autobatch.probe.caching.cache_key`; the probe's argument checks reuse them)."""

from __future__ import annotations

from typing import Any, Callable

from ..snapshot.rng import own_generators, rng_state, set_rng_state
from ..tracing.trace_state import OutsideState
from ..tracing.trace_writes import RealWrites

__all__ = ["sample_batches"]


def sample_batches(make_batch: Callable[[int], Any], sizes: tuple[int, ...] = (1, 2), *,
                   real: bool = True) -> tuple[Any, ...] | None:
    """``make_batch(n)`` for each of ``sizes``, built with fake tensors (no memory) where it can,
    else for real (``real=False``: None instead, where a real batch could be too large to build,
    as at a probe's answer, :mod:`~autobatch.probe.batch_growth`); every random generator put
    back after (the key is read before the probe's snapshot is taken; ``make_batch``'s own too,
    :func:`~autobatch.probe.snapshot.rng.own_generators`), and what make_batch
    reaches too (a batch it memoises in a closure or an ``lru_cache`` would hand the trials a
    fake tensor: :mod:`~autobatch.probe.tracing.trace_state`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    saved = rng_state(own=own_generators([make_batch], [make_batch]))
    outside = OutsideState({"make_batch": make_batch}, [make_batch])
    try:
        try:
            with FakeTensorMode(allow_non_fake_inputs=True), RealWrites():  # a real tensor it writes: put back
                return tuple(make_batch(size) for size in sizes)
        finally:
            outside.put_back()
    except Exception:  # noqa: BLE001 - a make_batch fake tensors cannot run: build them for real
        return tuple(make_batch(size) for size in sizes) if real else None
    finally:
        set_rng_state(saved)
