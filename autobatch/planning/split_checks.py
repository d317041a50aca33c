"""Whether cutting a ``TrainStep``'s batches along dim 0 trains what one batch would.

A plan's micro-batches are cut along dim 0 (:func:`~autobatch.planning.accumulation.split_batch`,
the ``Runner``) and each one's loss weighted by its share of the samples. Two things the
planner's probes cannot see break that silently, and :func:`~autobatch.plan` checks both on a
small batch before it plans:

* **Samples not on dim 0** (:func:`check_batch_first`). ``make_batch(n)`` that builds a
  sequence-first batch (``[T, n, E]`` for ``nn.MultiheadAttention`` / ``nn.RNN`` with
  ``batch_first=False``) probes fine, for the probe never cuts a batch, but every split of it
  cut the *time steps*: attention then saw a piece of each sequence and the plan trained
  another model, without a word. autobatch has no batch-dimension option (every batch is
  batch-first, ``docs/runner.md``, "What a batch may hold"); where ``make_batch(1)`` and
  ``make_batch(2)`` have the same dim 0, it is one ``ValueError`` naming the dim that grows.
* **A loss that is not a mean over samples** (:func:`loss_split_note`): a contrastive loss
  over the batch (CLIP's in-batch negatives), a token mean over padded sequences, a
  ``reduction='sum'`` loss, class weights. Their accumulated gradient is another one than the
  global batch's (a tiny CLIP's differed by 14 in its largest entry, its loss by ``log 2``), so
  a plan that splits says so, as it does for BatchNorm (:mod:`.batch_statistics`).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from ..memory.uncompiled import uncompiled
from ..probe.caching.key_batches import sample_batches
from ..probe.snapshot.rng import rng_state, set_rng_state, step_generators
from ..probe.snapshot.shards import has_dtensors
from ..probe.train_step import TrainStep
from .samples import batch_size_of

__all__ = ["check_batch_first", "loss_split_note", "LOSS_KINDS", "LOSS_SPLIT", "MEAN_LOSS"]

#: how the note begins
LOSS_SPLIT = "The loss is not a mean over samples"


def check_batch_first(step: TrainStep) -> None:
    """One ``ValueError`` where ``step.make_batch(1)`` and ``make_batch(2)`` have the same number
    of samples on dim 0 while some tensor grows on another dim: the batch is not batch-first, and
    a plan's split would cut that dim 0 (time steps) silently. Batches make_batch cannot build
    here, or whose size cannot be read, are left to the probe's own checks."""
    try:
        batches = sample_batches(step.make_batch)
    except Exception:  # noqa: BLE001 - not swallowed: the probe's trials call make_batch and raise it
        return
    try:
        one, two = (batch_size_of(batch) for batch in batches)
    except ValueError:  # the probe and the split raise it, with its own advice
        return
    if one != two:
        return
    grown = _grown_dim(batches[0], batches[1])
    if grown is None:
        return
    path, dim, shape = grown
    raise ValueError(
        f"make_batch(n) does not put its n samples on dim 0: make_batch(1) and make_batch(2) both have {one} on dim 0, "
        f"and {path} grows on dim {dim} ({shape}). plan() and the Runner cut batches into micro-batches along dim 0, "
        "so a split would cut that dim (a sequence-first batch's time steps) instead of samples; autobatch takes "
        "batch-first batches only. Build them batch-first (.transpose(0, 1) in make_batch and the collate) and "
        "transpose back in the loss_fn, or use the model's batch_first=True; see 'What a batch may hold' in docs/runner.md"
    )


def _grown_dim(one: Any, two: Any) -> tuple[str, int, str] | None:
    """The first tensor of ``two`` that has one dim doubled from ``one``'s (a batch of 1 and 2):
    its place, that dim, and its shape."""
    shapes = dict(_shapes(one, "batch"))
    for path, shape in _shapes(two, "batch"):
        before = shapes.get(path)
        if before is None or len(before) != len(shape):
            continue
        for dim, (a, b) in enumerate(zip(before, shape)):
            if dim > 0 and b == 2 * a and all(x == y for i, (x, y) in enumerate(zip(before, shape)) if i != dim):
                return path, dim, f"{list(before)} in a batch of 1, {list(shape)} in one of 2"
    return None


def _shapes(node: Any, path: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(place, shape)`` of every tensor in ``node`` (dicts, lists, tuples, dataclass fields)."""
    if isinstance(node, torch.Tensor):
        return [(path, tuple(node.shape))]
    if isinstance(node, dict):
        items = [(f"{path}[{key!r}]", value) for key, value in node.items()]
    elif isinstance(node, (list, tuple)):
        items = [(f"{path}[{index}]", value) for index, value in enumerate(node)]
    elif hasattr(node, "__dataclass_fields__"):
        items = [(f"{path}.{name}", getattr(node, name)) for name in node.__dataclass_fields__]
    else:
        return []
    return [found for place, value in items for found in _shapes(value, place)]


def loss_split_note(step: TrainStep, sizes: list[int], piece: int = 1) -> str | None:
    """A note for a plan that splits (``sizes``: more than one micro-batch) a step whose loss is not a
    mean over pieces of ``piece`` samples (``multiple_of``), read in eval mode (no dropout, BatchNorm's
    running statistics: :mod:`.batch_statistics` notes those) without gradients; the model's modes,
    buffers and every random generator are put back. On ``make_batch(8 * piece)``, the loss of each group
    of pieces of two cuts (:func:`_groups`, one uneven) is held against the mean of its pieces' losses:
    several comparisons, for one can agree by chance (a token mean over two samples of one length, or
    whose per-sample weights cancel), to a tolerance near the dtype's rounding (:func:`_tolerance`), for an
    untrained model's per-token losses are all about ``log V`` and a token mean moves its loss by 1e-4 of
    it. A loss that draws random numbers in eval mode (a VAE's reparameterisation, noise injected in
    forward) is judged by the means of :data:`RANDOM_DRAWS` draws (:func:`_split_differs`). None where the
    split is exact, or where the check cannot run (a model that does not compute its loss in eval mode:
    the trials and the run raise their own errors)."""
    if len(sizes) < 2 or _distributed(step.model):
        return None
    most = max(2, min(CHECK_PIECES, max(sizes) // piece))  # a group's forward takes less than a micro-batch's step
    first = max(1, 3 * most // 8)  # the uneven cut: 3 and 5 of 8 pieces, 1 and 1 of 2
    draws = _losses(step, piece, most, first)
    if not draws:
        return None
    drawn = ""
    if isinstance(draws, list):  # the loss draws random numbers in eval mode: judge the mean of many draws
        if not _split_differs(draws, first / most):
            return None
        whole, one, two = (sum(draw[i] for draw in draws) / len(draws) for i in range(3))
        drawn = f" (means of {len(draws)} draws: the loss draws random numbers in eval mode)"
        found = (f"on its first {most * piece} samples, and {one:.4g} and {two:.4g} on their {first * piece} and "
                 f"{(most - first) * piece}")
    else:
        pieces, groups = draws
        gaps = [(abs(loss - sum(pieces[start:start + size]) / size), start, size, loss) for start, size, loss in groups]
        gap, start, size, whole = max(gaps)
        if gap <= _tolerance(step) * max(*map(abs, pieces), *(abs(g[3]) for g in gaps), 1e-2):
            return None
        mean = sum(pieces[start:start + size]) / size
        found = (f"on its samples {start * piece} to {(start + size) * piece - 1}, and a mean of {mean:.4g} over "
                 f"{'each of them alone' if piece == 1 else f'their pieces of {piece}'}")
    return (
        f"{LOSS_SPLIT}: on make_batch({CHECK_PIECES * piece}) the loss_fn gave {whole:.4g} {found} (in eval mode){drawn}, "
        f"so the plan's micro-batches of {max(sizes)} train another gradient than one batch of {sum(sizes)} would "
        f"({LOSS_KINDS}). Where that matters: more memory (one step), or {MEAN_LOSS}"
    )


#: the pieces (of ``multiple_of`` samples) of the split check's batch
CHECK_PIECES = 8


def _groups(most: int, first: int) -> list[list[int]]:
    """Two cuts of :data:`CHECK_PIECES` pieces into groups of at most ``most`` (the plan's largest micro-batch, in
    pieces): even (8; 4 and 4; four 2s), and uneven, ``first`` pieces then groups of ``most`` (3 and 5; 1, 4 and 3;
    1, 2, 2, 2 and 1). A token mean whose groups' lengths happen to match, or whose weights cancel, in one cut
    rarely does in both (a token model's losses, 2 to 12 real tokens of 12, moved by 1e-4 at the least on 40 seeds)."""
    even = [min(most, CHECK_PIECES - start) for start in range(0, CHECK_PIECES, most)]
    rest = CHECK_PIECES - first
    return [even, [first] + [min(most, rest - start) for start in range(0, rest, most)]]


def _starts(sizes: list[int]) -> list[int]:
    """Where each group of ``sizes`` (in pieces) begins."""
    return [sum(sizes[:index]) for index in range(len(sizes))]


def _tolerance(step: TrainStep) -> float:
    """The relative gap the check lets pass: 2e-2 where the loss is computed in 16 bits (autocast, or
    16-bit parameters), whose matmuls round by the batch's shape; 1e-3 in float32 on an accelerator that
    may round it to TF32 (CUDA's convolutions do by default, its matmuls under
    ``set_float32_matmul_precision("high")``, other accelerators as they choose: a 10-bit mantissa, and
    kernels chosen by the batch's shape); else 1e-5, far above float32's rounding by the batch's shape (on
    the CPU a mean over samples' groups agreed with their pieces to 2e-7 of the loss) and below what a
    token mean of an untrained model's nearly equal per-token losses moves it by."""
    half = (torch.bfloat16, torch.float16)
    parameters = list(step.model.parameters())
    if step.autocast_dtype in half or any(p.dtype in half for p in parameters):
        return 2e-2
    kinds = {p.device.type for p in parameters}
    exact = kinds <= {"cpu", "meta"} or (kinds == {"cuda"} and not torch.backends.cuda.matmul.allow_tf32
                                         and not torch.backends.cudnn.allow_tf32)
    return 1e-5 if exact else 1e-3


#: the losses that are no mean over samples, as the notes name them
LOSS_KINDS = "a contrastive loss over the batch, a mean over padded tokens, a sum, class weights"
#: what to return instead, as the notes (the plan's, the Runner's: :mod:`autobatch.training.split_warnings`) say it
MEAN_LOSS = (
    "a loss_fn that returns a mean of per-sample terms: a sum divided by the micro-batch's samples; a token mean "
    "weighted per sample by the batch's samples over its real tokens (docs/runner.md, the token_weight recipe; "
    "docs/planning.md, 'Accumulation policy')"
)


def _distributed(model: torch.nn.Module) -> bool:
    """A model whose forward runs collectives (FSDP2's all-gathers, under DDP a group): not
    checked. An eval forward of a ``fully_shard``-ed root leaves its parameters unsharded (plain
    tensors) until a backward, and a rank whose check failed would leave its peers waiting."""
    return has_dtensors(model) or (torch.distributed.is_available() and torch.distributed.is_initialized())


#: draws of a random loss (one that draws random numbers in eval mode, as a VAE's reparameterisation) compared
RANDOM_DRAWS = 16


def _split_differs(draws: list[tuple[float, ...]], share: float) -> bool:
    """Whether a random loss's whole-batch draws differ from what its cut accumulates (its first part's
    loss weighted by ``share``, the second's by the rest) by more than their noise: the mean difference
    beyond four standard errors (a mean of per-sample terms, as a VAE's, differs by noise alone, whose
    expectation is 0) and beyond 1e-3 of the loss."""
    diffs = [whole - share * first - (1 - share) * second for whole, first, second in draws]
    mean = sum(diffs) / len(diffs)
    spread = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1))
    scale = max(abs(whole) for whole, _, _ in draws)
    return abs(mean) > 4 * spread / math.sqrt(len(diffs)) and abs(mean) > 1e-3 * scale + 1e-5


def _losses(step: TrainStep, piece: int, most: int, first: int) -> Any:
    """``loss_fn`` on ``make_batch(8 * piece)`` as floats: ``(pieces, groups)``, each piece's loss and
    ``(start, size, loss)`` for each group of more than one piece (:func:`_groups`); or, where the first
    group's loss taken again (the generators advanced) differed, a list of :data:`RANDOM_DRAWS` draws of that
    group's loss and of its two parts (``first`` pieces, the rest): the loss draws random numbers in eval mode,
    and one draw of each tells nothing (a VAE whose loss is a mean over samples gave 14.97 on a batch of 2 and
    14.5 and 18.03 on its halves). None where the loss raised. A ``torch.compile``d model runs uncompiled here
    (:func:`~autobatch.memory.uncompiled.uncompiled`): before, each of the check's sizes (8, 1, 3 and 5, in eval
    mode without grad) compiled a graph the run never uses (seconds each with inductor) and, with ``dynamic=False``,
    took half of dynamo's recompile limit (8): a few OOM replays later the run went uncompiled, or raised with
    ``fullgraph=True``."""
    from .accumulation import cut_batch

    model = step.model
    modes = [(module, module.training) for module in model.modules()]
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    saved = rng_state(own=step_generators(step))
    try:
        model.eval()
        with torch.no_grad(), step.autocast(), uncompiled():
            batch = step.make_batch(CHECK_PIECES * piece)
            group = cut_batch(batch, lambda total: [most * piece, total - most * piece])[0] if most < CHECK_PIECES else batch
            whole = _loss(step, group)
            if not math.isclose(_loss(step, group), whole, rel_tol=1e-6):  # random in eval mode
                parts = [group, *cut_batch(group, lambda total: [first * piece, total - first * piece])]
                return [tuple(_loss(step, part) for part in parts) for _ in range(RANDOM_DRAWS)]
            pieces = [_loss(step, part) for part in cut_batch(batch, lambda total: [piece] * CHECK_PIECES)]
            groups = [(0, most, whole)]  # the first group of the even cut, taken already
            for cut in _groups(most, first):
                parts = cut_batch(batch, lambda total, cut=cut: [size * piece for size in cut])
                for start, size, part in zip(_starts(cut), cut, parts):
                    if size > 1 and (start, size) != (0, most):
                        groups.append((start, size, _loss(step, part)))
            return pieces, groups
    except Exception:  # noqa: BLE001 - an advisory check: the step's own errors come from its trials
        return None
    finally:
        for module, training in modes:
            module.training = training
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
        set_rng_state(saved)


def _loss(step: TrainStep, batch: Any) -> float:
    """The loss ``loss_fn`` returns on ``batch`` (a tensor, or a dict's or model output's
    ``"loss"``, as :func:`~autobatch.checks.loss` takes it; that one refuses a loss without grad)."""
    value = step.loss_fn(step.model, batch)
    if isinstance(value, Mapping):
        value = value["loss"]
    elif not isinstance(value, torch.Tensor) and hasattr(value, "loss"):
        value = value.loss
    return float(value)
