"""The probe's arguments: what each accepts, checked before any trial runs, and the defaults.

Every bad value raises one ``ValueError`` that names the argument and what it accepts.
"""

from __future__ import annotations

import inspect
import numbers
import sys
from collections.abc import Iterator
from typing import Any

import torch

from .. import checks
from ..memory.allocator import LARGE_PAGE_BYTES
from ..memory.devices import indexed
from .batch_growth import batch_shapes, shapes_summary
from .caching.cache_key import sample_batches
from .train_step import TrainStep

__all__ = [
    "STRATEGY_NAMES", "HALVING_DEFAULT_START", "PREDICT_DEFAULT_START", "ALLOCATOR_HEADROOM",
    "EXPANDABLE_HEADROOM_BYTES", "SEARCH_CEILING",
    "validate_probe_args", "validate_step", "validate_places", "hand_loop_of", "compiled_model",
    "simulated_compile_note", "compiled_plan_notes", "checked_batches", "refuse_iterator", "IteratorBatchError",
]

STRATEGY_NAMES = ("auto", "predict", "binary", "power", "halving", "estimate")
#: Peers' names for a strategy (Lightning's ``scale_batch_size(mode=...)``), suggested where given.
STRATEGY_ALIASES = {"binsearch": "binary", "bisect": "binary", "bisection": "binary", "doubling": "power",
                    "predictive": "predict", "estimated": "estimate"}
#: Peers' names for ``find_max_batch``'s keywords (Accelerate's, Lightning's), suggested where given.
FIND_ALIASES = {"starting_batch_size": "start", "init_val": "start", "batch_size": "start", "mode": "strategy",
                "max_batch_size": "max_batch", "max_val": "max_batch", "steps": "steps_per_trial",
                "steps_per_trial_count": "steps_per_trial", "max_memory": "memory_limit", "memory": "memory_limit",
                "limit": "memory_limit", "cap": "memory_limit", "capacity": "memory_limit", "fraction": "margin", "headroom": "margin"}
#: Where ``halving`` starts when neither ``start`` nor ``max_batch`` is given.
HALVING_DEFAULT_START = 1024
#: Where ``predict`` (and ``auto``) start when ``start`` is not given, in samples (rounded down
#: to a multiple of ``multiple_of``, at least one multiple). Why 8, not 1: the first trial's
#: peak feeds the fit and the leap (:mod:`autobatch.probe.searching.predict`), and at batch 1 a step's peak is
#: distorted by what does not grow with the batch (the optimizer step's temporaries, cuDNN's
#: small-batch workspaces: ResNet-50's batch-1 peak lies 20 MiB, half a sample, above its
#: line). Batch 8 fits nearly every model that trains on the device; where it does not, that
#: first trial is an OOM, the cheapest trial, and the search bisects below it.
PREDICT_DEFAULT_START = 8
#: On an accelerator, the fraction of the capacity a trial's allocated peak must leave free to
#: pass: the caching allocator's room for block rounding and fragmentation. A step that fills
#: more fits only while fragmentation is kind. Measured on an H200 under a 16 GiB cap:
#: ResNet-50 at batch 370 peaked at 99.03 % allocated (99.8 % reserved) and passed 3 steps in
#: the probe, then ran out of memory at the 7th step of training in the same process; at 369
#: (98.9 %) training ran. The predictive line aims at the same limit.
ALLOCATOR_HEADROOM = 0.01
#: With expandable segments on CUDA under a per-process cap, the bytes a passing trial's
#: allocated peak must leave free instead (where that is less than ``ALLOCATOR_HEADROOM``): two
#: of the allocator's large pages (:data:`~autobatch.memory.allocator.LARGE_PAGE_BYTES`, 20 MiB).
#: There the allocator maps memory page by page and, when a request does not fit, unmaps the
#: free pages and maps them where it does, so fragmentation costs the partly used pages around
#: the free pieces; a step that needs such a flush at every step is at the cap, and fails the
#: answer's trial (:mod:`~autobatch.probe.settling`, :func:`~autobatch.probe.searching.search.allocator_headroom`).
#: Measured on an H200 under an 8 GiB cap (ResNet-50 with cuDNN autotuning, the command line):
#: under the fixed 1 % the tuned 182 failed only the headroom (7.92 GiB allocated) and the
#: answer was 181, while 182 and 183 trained 200 steps in new processes; with two pages it
#: answers 183, which trained 200 steps in a new process (``docs/promise-log.md`` has every workload).
EXPANDABLE_HEADROOM_BYTES = 2 * LARGE_PAGE_BYTES
#: Without ``max_batch``, the largest size a search tries: 2**24 = 16,777,216 samples. A step
#: that never runs out of memory (a no-op, a model that keeps nothing per sample) would
#: otherwise double for ever; at the ceiling the search stops, and the result's notes say that
#: no OOM was seen below it. Pass ``max_batch`` to search higher (or lower).
SEARCH_CEILING = 2**24
#: The size :func:`checked_batches` builds a third batch at, where ``make_batch(1)`` and
#: ``make_batch(2)`` are the same: small enough to build for real where fake tensors cannot.
CHECK_SIZE = 64


def validate_probe_args(
    *,
    start: int | None,
    max_batch: int | None,
    strategy: str,
    margin: float,
    multiple_of: int,
    steps_per_trial: int,
    search_steps: int | None = None,
    estimate_first: bool | None = None,
) -> dict[str, Any]:
    """Raise ``ValueError`` (``TypeError`` for ``estimate_first``) naming the argument and what it
    accepts. Return the numbers as plain Python ones, by argument name (``estimate_first`` aside):
    any integer type is taken (a NumPy ``int64`` from a config), and what the probe stores (the
    cache key, the result) must hold ``int``."""
    checks.flag("estimate_first", estimate_first, allow_none=True, none_means="on for the CPU's simulated device")
    start = checks.positive_int("start", start, allow_none=True)
    max_batch = checks.positive_int("max_batch", max_batch, allow_none=True)
    search_steps = checks.positive_int("search_steps", search_steps, allow_none=True)
    multiple_of = checks.positive_int("multiple_of", multiple_of)
    steps_per_trial = checks.positive_int("steps_per_trial", steps_per_trial)
    checks.choice("strategy", strategy, STRATEGY_NAMES, aliases=STRATEGY_ALIASES)
    if isinstance(margin, bool) or not isinstance(margin, numbers.Real) or not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be a fraction in [0, 1), e.g. 0.05 for 5%; got {margin!r}")
    if start is not None and max_batch is not None and start > max_batch:
        raise ValueError(f"start={start} is larger than max_batch={max_batch}; lower start or raise max_batch")
    if max_batch is not None and max_batch < multiple_of:
        raise ValueError(
            f"max_batch={max_batch} is smaller than multiple_of={multiple_of}, so no batch size "
            "is allowed; raise max_batch or lower multiple_of"
        )
    return dict(start=start, max_batch=max_batch, margin=float(margin), multiple_of=multiple_of,
                steps_per_trial=steps_per_trial, search_steps=search_steps)


def validate_step(fn: object, strategy: str) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``fn`` is something the probe can run:
    a callable taking the batch size (a :class:`~autobatch.TrainStep` for ``estimate``). A
    model is callable too, but ``model(batch_size)`` is no step: it failed in the first trial
    with an error from inside the model; so did a function that takes no argument, or two
    (Python's bare "takes 0 positional arguments but 1 was given"), refused here instead."""
    if isinstance(fn, torch.nn.Module):
        raise TypeError(
            f"fn is a model ({type(fn).__name__}), not a training step: the probe calls fn(batch_size). Wrap the "
            "model in autobatch.TrainStep(model, optimizer, loss_fn, make_batch), or pass a function that runs one "
            "training step at a batch size"
        )
    if not callable(fn):
        raise TypeError(
            f"fn must be a callable that runs one training step at a given batch size, e.g. "
            f"autobatch.TrainStep(model, optimizer, loss_fn, make_batch); got {type(fn).__name__} {fn!r:.60}"
        )
    if _takes_one(fn) is False:
        raise TypeError(
            f"fn is called as fn(batch_size), and {getattr(fn, '__qualname__', type(fn).__name__)}"
            f"{inspect.signature(fn)} cannot be called so: give it one parameter, the batch size, e.g. "
            "def step(batch_size): ... (or wrap it: lambda batch_size: fn(model, batch_size))"
        )
    if isinstance(fn, TrainStep) and fn.make_batch is None:
        raise ValueError(
            "this TrainStep has no make_batch: the probe builds each trial's batch with make_batch(batch_size); "
            "pass make_batch=lambda n: ... (a batch of n samples on the device) to TrainStep"
        )
    if strategy == "estimate" and not isinstance(fn, TrainStep):
        raise ValueError(
            f"strategy='estimate' traces a TrainStep with fake tensors; got {type(fn).__name__}. "
            "Wrap the step in autobatch.TrainStep or pick another strategy"
        )


def _takes_one(fn: object) -> bool | None:
    """Whether ``fn(batch_size)`` binds to ``fn``'s signature; None where Python cannot read it
    (a builtin): then the first trial tells."""
    try:
        signature = inspect.signature(fn)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(1)
    except TypeError:
        return False
    return True


def validate_places(device: object, restore: object, cache: object, step: object = None) -> None:
    """Check where the probe runs, what it restores and where it caches (and that a ``TrainStep``
    ``step`` has its model on ``device``: :func:`_step_on_device`)."""
    import os

    checks.torch_device("device", device)
    checks.device_available("device", device)
    _step_on_device(step, device)
    if restore is not None:
        if not isinstance(restore, tuple) or len(restore) < 2:
            raise TypeError(
                "restore must be a (model, optimizer) pair, optionally followed by objects with state_dict() "
                "and load_state_dict() (an LR scheduler, a GradScaler), or None; "
                + ("a list is not taken: pass the same items as a tuple, restore=(model, optimizer, ...); "
                   if isinstance(restore, list) else "")
                + f"got {type(restore).__name__} {checks.shown(restore)}"
            )
        checks.module("restore[0]", restore[0])
        checks.materialized("restore[0]", restore[0])
        if isinstance(restore[1], torch.nn.Module):  # a second model (a GAN's) in the optimizer's place
            raise TypeError(
                f"restore[1] must be the optimizer of restore[0], got a second model ({type(restore[1]).__name__}): "
                "restore is (model, optimizer, *more), and each further model or optimizer follows the first pair "
                "(put back through its state_dict()), e.g. for a GAN restore=(G, opt_G, D, opt_D)"
            )
        if restore[1] is not None:
            checks.optimizer("restore[1]", restore[1])
        for i, item in enumerate(restore[2:], start=2):
            if not (callable(getattr(item, "state_dict", None)) and callable(getattr(item, "load_state_dict", None))):
                raise TypeError(
                    f"restore[{i}] must have state_dict() and load_state_dict() (an LR scheduler, a GradScaler: what "
                    f"the step advances), got {type(item).__name__} {item!r:.60}"
                )
    if isinstance(cache, str) and cache.strip().lower() in checks.BOOLEAN_WORDS:
        raise ValueError(
            f"cache={cache!r} reads as a boolean, but a string is the cache's directory: pass "
            f"cache={checks.BOOLEAN_WORDS[cache.strip().lower()]} (the bool), or a path such as './{cache}' for a "
            "directory of that name"
        )
    if cache is not None and not isinstance(cache, (bool, str, os.PathLike)):
        raise TypeError(f"cache must be True, False, None or a directory path, got {type(cache).__name__} {cache!r:.60}")


def _step_on_device(step: object, device: object) -> None:
    """A ``TrainStep`` given a ``device`` that holds none of its model's tensors is one ``ValueError``:
    its trials run where the model is, and the memory read was ``device``'s, so a model left on the CPU
    probed with ``device="cuda"`` passed every trial at no memory and climbed to the search ceiling.
    A model spread over devices passes where one of its tensors is on ``device``. A bare ``"cuda"`` is
    the current device (:func:`~autobatch.memory.devices.indexed`), whose memory is read: it passed a
    model on ``cuda:1`` while ``cuda:0`` was current."""
    if not isinstance(step, TrainStep) or device is None:
        return
    wanted = torch.device(device)
    places = {t.device for t in (*step.model.parameters(), *step.model.buffers())}
    if not places:
        return
    if any(p.type == wanted.type for p in places):  # only then read the current index (none on a CPU-only host)
        if wanted.type == "cpu":  # one CPU, "cpu:0" or "cpu"
            return
        wanted = indexed(wanted)
        if any(indexed(p) == wanted for p in places):
            return
    held = ", ".join(sorted(map(str, places)))
    current = f" (the current device, {wanted})" if wanted != torch.device(device) else ""
    raise ValueError(f"device={device!r}{current}, but the TrainStep's model is on {held}, where its trials run: move "
                     f"the model there first (model.to({str(wanted)!r})), or pass device={held.split(', ')[0]!r} (or drop device=: "
                     "the model's device is the default)")


def hand_loop_of(fn: object, hand_loop: bool | None) -> tuple[bool, list[str]]:
    """Whether a loop that cannot replay a step trains ``fn``'s answer, and the notes saying why
    where it was decided for the user: ``hand_loop`` as given; by default True for a plain
    callable (the user's own loop) and for a :class:`~autobatch.TrainStep` whose model runs under
    ``torch.compile`` (:func:`compiled_model`), False for any other ``TrainStep`` (autobatch's
    Runner, which replays)."""
    if hand_loop is not None and not isinstance(hand_loop, bool):
        raise TypeError(f"hand_loop must be True, False or None (decided by the step's type), got {hand_loop!r:.60}")
    if hand_loop is not None or not isinstance(fn, TrainStep):
        return (not isinstance(fn, TrainStep) if hand_loop is None else hand_loop), []
    if not compiled_model(fn.model):
        return False, []
    return True, [COMPILED_NOTE]


def compiled_plan_notes(fn: object, hand_loop: bool | None) -> list[str]:
    """The notes a compiled ``TrainStep``'s probes give in their results only, for :func:`~autobatch.plan`,
    whose summary showed neither: probed under a hand loop's rules (:func:`hand_loop_of`, where
    ``hand_loop`` is left None), and on the CPU, whose probes run on the simulated device, that the
    trials ran the uncompiled code (:func:`simulated_compile_note`). Before, a plan made on the CPU
    from a ``torch.compile``'d model sized the eager step and said nothing of it."""
    if not isinstance(fn, TrainStep) or not compiled_model(fn.model):
        return []
    return hand_loop_of(fn, hand_loop)[1] + (simulated_compile_note(fn.model) if fn.device.type == "cpu" else [])


def eval_mode_notes(fn: object) -> list[str]:
    """The note (a list of one, else empty) where a ``TrainStep``'s model is in eval mode
    (``model.eval()`` left from a validation pass): its trials train as it is, Dropout without
    masks and BatchNorm on its running statistics, which keep less for backward than training
    mode; a run that calls ``model.train()`` first can need more memory than the answer measured. The mode is the user's
    (the probe keeps it, and the cache key holds it), so this is a note, not a change."""
    if not isinstance(fn, TrainStep) or fn.model.training:
        return []
    return ["the model is in eval mode (model.eval()): the trials trained it so (Dropout off, BatchNorm on its "
            "running statistics), which can take less memory than training mode; call model.train() before the "
            "probe if training runs in train mode"]


def gradless_note(fn: object) -> str | None:
    """A note where the last step of a ``TrainStep``'s trials left parameters its optimizer trains without a
    gradient (:attr:`TrainStep.gradless <autobatch.probe.train_step.TrainStep.gradless>`): the answer holds no
    optimizer state for them, and where they should train, the step does not train them."""
    without, trainable = getattr(fn, "gradless", None) or (0, 0)
    if not without:
        return None
    return (f"{without} of the {trainable} parameters the optimizer trains got no gradient in the trials' last step, "
            "so the answer holds no optimizer state for them: parameters the loss does not use, or parameters inside "
            "a torch.utils.checkpoint.checkpoint(..., use_reentrant=True) whose inputs do not require grad (LoRA "
            "adapters after a frozen embedding), which torch gives no gradient: pass use_reentrant=False")


#: why a torch.compile'd TrainStep is probed as a hand loop (:func:`hand_loop_of`)
COMPILED_NOTE = (
    "probed under a hand loop's rules (the optimizer state laid out as a resumed run has it; hand_loop=False "
    "to probe as an uncompiled TrainStep): the model runs under torch.compile, and a new process compiles in its "
    "first step, among that step's activations, which the trials (whose sizes share one compiled graph) do not"
)


def simulated_compile_note(model: torch.nn.Module | None) -> list[str]:
    """The note (a list of one, else empty) where a compiled model is probed on the CPU's simulated
    device: ``torch.compile`` does not compile under a ``TorchDispatchMode`` (the simulation is one),
    so the trials ran the model's eager code, and nothing said so (torch 2.13: no graph compiled,
    a trial 0.06 s where compiling takes seconds). The answer is the eager step's."""
    if model is None or not compiled_model(model):
        return []
    return ["the model is compiled (torch.compile), which does not compile under the simulated device (a torch "
            "dispatch mode): the trials ran its uncompiled code, so the answer is the eager step's, whose peak the "
            "compiled graph's may differ from; probe on the accelerator to measure the compiled step"]


def compiled_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` or a module in it runs under ``torch.compile`` (an ``OptimizedModule``
    wrapper, or ``Module.compile()`` in place).

    Why it matters: the trials' sizes share the graphs the first ones compiled, where a training
    process compiles its own graph in its first step. Measured on an H100 (GPT-2 small compiled,
    bf16, 8 GiB cap, ``scripts/diag_compile.py``): a ``TrainStep``'s trials passed 6, which then
    ran out of memory at step 1 in new processes (as a ``TrainStep`` called by hand, the
    ``Runner``, a plain loop; compiled static or with ``dynamic=True``) and in the probing
    process's ``Runner``; 5, a plain callable's answer under a hand loop's rules, trained."""
    if "torch._dynamo" not in sys.modules:  # nothing was compiled in this process
        return False
    from torch._dynamo.eval_frame import OptimizedModule

    return any(isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None
               for m in model.modules())


class IteratorBatchError(ValueError):
    """``make_batch(n)`` returned an iterator (:func:`refuse_iterator`): raised as it is by the probe and by
    the fake-tensor estimate, whose trace would otherwise report it as one of the step's own errors."""


def refuse_iterator(batch: Any) -> Any:
    """``batch``, where it is one; :class:`IteratorBatchError` where ``make_batch`` returned an iterator
    (a generator function that ``yield``s its batch, ``iter([batch])``): single-use, and no batch, so
    the step fed it to the model and torch said only ``must be Tensor, not generator``. Shared by
    :func:`checked_batches` (the probe's trials) and the estimate's trace
    (:func:`~autobatch.probe.tracing.estimate.estimate_memory`), so both say the same."""
    if isinstance(batch, Iterator):
        raise IteratorBatchError(
            f"make_batch returned an iterator ({type(batch).__name__}), not a batch: every step (a trial's, or the "
            "estimate's trace) runs make_batch(n)'s batch itself, so make_batch(n) must return one batch of n samples "
            "(a tensor, or a tuple/list/dict of tensors); return it instead of yielding it, e.g. "
            "make_batch=lambda n: (torch.randn(n, 512), torch.randint(0, 10, (n,)))"
        )
    return batch


def checked_batches(step: TrainStep) -> tuple[Any, Any] | None:
    """``make_batch(1)`` and ``make_batch(2)`` (:func:`~autobatch.probe.caching.cache_key.sample_batches`,
    reused by the cache key), after checking that the batch changes with its size: a
    ``make_batch`` that ignores its argument runs the same batch in every trial, none runs out of
    memory, and the search climbed to :data:`SEARCH_CEILING` and answered it with only a note.
    Where 1 and 2 build the same batch, so does :data:`CHECK_SIZE` before it is refused (a
    make_batch may pad to 2 samples for ``BatchNorm``). None where the two cannot be built (a
    make_batch that takes only multiples of 8): the cache key builds them again and notes why,
    and the trials call make_batch at their own sizes, where its error is raised."""
    try:
        batches = sample_batches(step.make_batch)
    except Exception:  # noqa: BLE001 - not swallowed: raised again by the key or by the trials (above)
        return None
    refuse_iterator(batches[0])
    first = batch_shapes(batches[0])
    if first == batch_shapes(batches[1]) and first == batch_shapes(sample_batches(step.make_batch, (CHECK_SIZE,))[0]):
        raise ValueError(
            f"make_batch ignores its batch size: make_batch(1), make_batch(2) and make_batch({CHECK_SIZE}) built the "
            f"same batch ({shapes_summary(first)}), so every trial would run that batch and none could run out of memory; "
            "make_batch(n) must build a batch of n samples, e.g. "
            "make_batch=lambda n: (torch.randn(n, 512), torch.randint(0, 10, (n,)))"
        )
    return batches
