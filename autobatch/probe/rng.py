"""Every random generator a training step may draw from, read and put back.

torch's CPU and CUDA generators, Python's ``random``, NumPy's global generator, and a data
loader's own (``generators``): a probe's trials and the cache key's batches must leave them as
they found them (:mod:`~autobatch.probe.restore`, :mod:`~autobatch.probe.cache_key`), and a
checkpoint carries them so a resumed run draws what the interrupted one would have
(:mod:`~autobatch.training.checkpoint_io`). The states are tensors and plain values, so a
checkpoint holding them loads with ``weights_only=True``.
"""

from __future__ import annotations

import logging
import random
from typing import Any, Sequence

import torch

__all__ = ["rng_state", "set_rng_state"]

log = logging.getLogger("autobatch")


def rng_state(generators: Sequence[torch.Generator] = ()) -> dict[str, Any]:
    """The CPU, CUDA (every device, when initialised), Python and NumPy generator states, and
    those of ``generators`` (a data loader's own: :func:`data_generators`)."""
    version, keys, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(keys), gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy
    except ImportError:  # numpy is optional
        pass
    else:
        name, keys, position, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = [name, torch.from_numpy(keys.astype("int64")), int(position), int(has_gauss), float(cached)]
    if generators:
        state["data"] = [generator.get_state() for generator in generators]
    return state


def set_rng_state(state: dict[str, Any], generators: Sequence[torch.Generator] = ()) -> None:
    """Put back what :func:`rng_state` returned (``generators``: the same data generators)."""
    torch.set_rng_state(state["torch"])
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        name, keys, position, has_gauss, cached = state["numpy"]
        keys = keys.numpy() if isinstance(keys, torch.Tensor) else numpy.asarray(keys)
        numpy.random.set_state((name, keys.astype(numpy.uint32), position, has_gauss, cached))
    saved = state.get("data", [])
    if generators and len(saved) == len(generators):
        for generator, generator_state in zip(generators, saved):
            generator.set_state(generator_state)
    elif generators or saved:
        log.warning(
            "resume: the checkpoint holds %d data-loader generator states and the data has %d; its order may "
            "differ from the interrupted run's", len(saved), len(generators),
        )
