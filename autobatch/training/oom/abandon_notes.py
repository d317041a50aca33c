"""The notes the runner adds to a user's (non-OOM) error that stopped a step, saying what the runner's
own changes of the micro-batch had to do with it.

Kept apart from :mod:`autobatch.training.oom.recovery` (the undo, shrink and replay) because these
only read the run's sizes and the error: they change nothing, and the error is raised as itself.

- :func:`note_shrunk`: the error came at a micro-batch a recovery shrank below every size that
  trained (BatchNorm in training needs more than one value per channel): what to set.
- :func:`note_recompile_limit`: a ``torch.compile``'d model met ``torch._dynamo``'s recompile limit
  with ``fullgraph=True`` (``FailOnRecompileLimitHit``, "Hard failure due to fullgraph=True"). Each
  micro-batch size its graphs do not cover compiles one more (every new size with ``dynamic=False``;
  an OOM replay's smaller size, a grow-back try, a short last batch's pieces), and past
  ``torch._dynamo.config.recompile_limit`` (8 by default) dynamo runs the frame uncompiled, which
  ``fullgraph=True`` forbids. Measured on the CPU (torch 2.13, ``aot_eager``, limit 2): the third
  size raised that error, and the shrink note above blamed the small size instead. Without
  ``fullgraph`` dynamo warns (its own log line) and trains on uncompiled, with the same gradients.
"""

from __future__ import annotations

from ...errors import add_note
from ...memory.units import counted
from ...probe.recompiles import recompile_limit_hit

__all__ = ["note_shrunk", "note_recompile_limit", "recompile_limit_hit"]


def note_recompile_limit(exc: BaseException, failed_at: int, step: int) -> bool:
    """Add the recompile-limit note to ``exc`` where it is that error (:func:`recompile_limit_hit`);
    returns whether it did."""
    if not recompile_limit_hit(exc):
        return False
    try:
        import torch._dynamo  # imported already: its error is here

        limit = f" ({torch._dynamo.config.recompile_limit})"
    except (ImportError, AttributeError):  # an older torch names it cache_size_limit
        limit = ""
    add_note(exc,
        f"autobatch: the compiled model reached torch._dynamo's recompile limit{limit} at micro-batch {failed_at} "
        f"in global step {step}: each micro-batch size its compiled graphs do not cover compiles another (with "
        "dynamic=False every new size: an out-of-memory replay's smaller one, a grow-back try, a short last "
        "batch's pieces), and fullgraph=True forbids running the rest uncompiled. Compile with dynamic=None (the "
        "default: the second size compiles one graph for all sizes) or dynamic=True, or raise "
        "torch._dynamo.config.recompile_limit. The step was undone; the steps before it stand (runner.save() keeps them).")
    return True


def note_shrunk(exc: BaseException, failed_at: int, smallest: int, *, step: int, last_shrink: tuple[int, int, int],
                fallback: bool) -> None:
    """Add the note where ``exc`` came at micro-batch ``failed_at`` (its split's smallest piece
    ``smallest``), smaller than every one that trained in the run, after a recovery shrank it:
    the smaller size is then likely what the model cannot take (BatchNorm in training needs more
    than one value per channel), which its own message does not say. ``last_shrink``: ``(step,
    before, after)`` of the last shrink; ``fallback``: whether ``checkpointing_fallback`` is on."""
    shrunk_at, before, after = last_shrink
    further = f", then to {failed_at}" if failed_at != after else ""
    turn_on = "" if fallback else ", turn on activation checkpointing (checkpointing_fallback=True)"
    piece = f" (its smallest piece: {counted(smallest, 'sample')})" if smallest < failed_at else ""
    add_note(exc,
        f"autobatch: this error came at micro-batch {failed_at}{piece} in global step {step}, smaller than any "
        f"micro-batch that trained in this run: after an out-of-memory error at micro-batch {before} (step {shrunk_at}) "
        f"the runner shrank it to {after}{further}. If the model cannot train on so few samples (BatchNorm needs "
        f"more than one value per channel in training), give it more memory{turn_on}, or pass "
        f"Runner(min_micro_batch={smallest + 1}) so that no piece is ever below that size (out of memory "
        "there, it raises StepOutOfMemoryError, or turns on checkpointing with checkpointing_fallback=True)."
    )
