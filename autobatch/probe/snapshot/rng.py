"""Every random generator a training step may draw from, read and put back.

torch's CPU and CUDA generators, Python's ``random``, NumPy's global generator, and a data
loader's own (``generators``): a probe's trials and the cache key's batches must leave them as
they found them (:mod:`~autobatch.probe.snapshot.restore`, :mod:`~autobatch.probe.caching.cache_key`), and a
checkpoint carries them so a resumed run draws what the interrupted one would have
(:mod:`~autobatch.training.checkpoints.checkpoint_io`). The states are tensors and plain values, so a
checkpoint holding them loads with ``weights_only=True``.

A step may also draw from generator objects of its own (``own``, :func:`own_generators`): a
``torch.Generator``, ``numpy.random.default_rng(0)``, a ``random.Random(0)`` that ``make_batch``
closes over or a module holds. The probe puts those back too, in memory (never in a checkpoint):
left advanced, a seeded run's data after a probe differed from the same run's after a cache hit,
which draws less (the cache key builds ``make_batch(1)`` and ``make_batch(2)``).
"""

from __future__ import annotations

import logging
import random
import sys
from typing import Any, Iterable, Sequence

import torch

from ..tracing.trace_state import _reachable, code_globals

__all__ = ["rng_state", "set_rng_state", "own_generators", "step_generators"]

log = logging.getLogger("autobatch")


def rng_state(generators: Sequence[torch.Generator] = (), own: Sequence[Any] = ()) -> dict[str, Any]:
    """The CPU, CUDA (every device, when initialised), Python and NumPy generator states, and
    those of ``generators`` (a data loader's own: :func:`data_generators`). ``own``: the step's
    own generator objects (:func:`own_generators`), kept with their states under ``"own"``, for
    :func:`set_rng_state` in this process only (not a checkpoint's value)."""
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
    if own:
        state["own"] = [(generator, _state_of(generator)) for generator in own]
    return state


def set_rng_state(state: dict[str, Any], generators: Sequence[torch.Generator] = ()) -> None:
    """Put back what :func:`rng_state` returned (``generators``: the same data generators)."""
    for generator, saved in state.get("own", ()):
        _set_state_of(generator, saved)
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


def own_generators(roots: Iterable[Any], functions: Iterable[Any] = ()) -> list[Any]:
    """The generator objects a step draws from besides the global ones: a ``torch.Generator``, a
    NumPy ``Generator``, ``RandomState`` or bit generator, a ``random.Random`` (not
    ``SystemRandom``, which has no state), reachable from ``roots`` (the model, the loss, the batch
    maker, a plain callable and its closure) or among the globals that ``functions``' code reads
    (as the fake-tensor trace walks them, :mod:`~autobatch.probe.tracing.trace_state`).

    Not the globals of the model's classes' code: reading every module class's methods to find one
    cost 0.13 s of each probe of GPT-2 small (0.27 of 0.32 s in ``dis``, on a 2-core CPU), for a
    generator that a model's own code keeps as a global, which a model holds as an attribute
    instead (found here)."""
    found = code_globals(list(functions))
    values = [*roots, *found.values()]
    return [value for value in _reachable(values, leaf=_is_generator) if _is_generator(value)]


def step_generators(fn: Any, more: Iterable[Any] = ()) -> list[Any]:
    """:func:`own_generators` of a probe's step: a ``TrainStep``'s model, loss, batch maker and
    optimizer, or a plain callable (its closure, the globals its code reads), and ``more`` (the
    objects in ``restore``)."""
    if all(hasattr(fn, name) for name in ("model", "loss_fn", "make_batch", "optimizer")):
        functions = [f for f in (fn.loss_fn, fn.make_batch) if f is not None]
        return own_generators([fn.model, fn.optimizer, *functions, *more], functions)
    return own_generators([fn, *more], [fn])


def _numpy_generators() -> tuple[type, ...]:
    numpy = sys.modules.get("numpy")  # a step that draws from NumPy imported it
    if numpy is None:
        return ()
    return numpy.random.Generator, numpy.random.RandomState, numpy.random.bit_generator.BitGenerator


def _is_generator(value: Any) -> bool:
    if isinstance(value, random.Random):
        return not isinstance(value, random.SystemRandom)
    return isinstance(value, (torch.Generator, *_numpy_generators()))


def _state_of(generator: Any) -> Any:
    if isinstance(generator, (torch.Generator, random.Random)):
        return generator.get_state() if isinstance(generator, torch.Generator) else generator.getstate()
    if hasattr(generator, "bit_generator"):  # numpy.random.Generator
        return generator.bit_generator.state
    return generator.get_state() if hasattr(generator, "get_state") else generator.state  # RandomState; a bit generator


def _set_state_of(generator: Any, state: Any) -> None:
    if isinstance(generator, torch.Generator):
        generator.set_state(state)
    elif isinstance(generator, random.Random):
        generator.setstate(state)
    elif hasattr(generator, "bit_generator"):
        generator.bit_generator.state = state
    elif hasattr(generator, "set_state"):
        generator.set_state(state)
    else:
        generator.state = state
