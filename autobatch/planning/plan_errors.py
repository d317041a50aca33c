"""The planner's errors when no plan exists: every probe attempt's figures, and what to change.

A mixin of the planner's per-call state (``step``, ``probes``, ``handle``, ``cache``, ``probe_kwargs``,
``allow_checkpointing``, ``targets``): :meth:`PlanErrors.no_fit` builds the ``NoBatchFitsError`` for "not
even batch 1 fits" (plainly, and with activation checkpointing where it was tried), carrying
every probe attempt in ``attempts``, and a hint that names what is left to try.
"""

from __future__ import annotations

from torch.utils.checkpoint import CheckpointError

from ..errors import NoBatchFitsError, add_note
from ..memory.oom import requested_bytes
from ..memory.units import counted, format_bytes
from ..probe.foreach import foreach_note
from .checkpointing import find_blocks, finer_blocks_hint, no_blocks_hint
from .own_checkpointing import cache_note, own_checkpointing, recomputed_blocks
from .plan_result import short_list
from .sparse_accumulation import has_sparse_gradients

__all__ = ["PlanErrors"]


class PlanErrors:
    """The planner's ``NoBatchFitsError`` messages (the planner provides its state)."""

    #: the blocks the model's own code recomputes in backward (:meth:`own`); None until looked for
    recomputed: list[str] | None = None

    def own(self) -> list[str]:
        """The modules of the model that checkpoint themselves, so the planner wraps none: Transformers'
        flag, else the blocks it would wrap that the model's code recomputes (``torch.utils.checkpoint`` in
        its forward; :func:`~.own_checkpointing.recomputed_blocks`, looked for once, at batch 2 or
        ``multiple_of``, BatchNorm's smallest in training, and only where checkpointing is about to be turned on)."""
        if self.recomputed is None:
            self.recomputed = [] if own_checkpointing(self.step.model) else recomputed_blocks(
                self.step, find_blocks(self.step.model, self.targets), max(2, self.probe_kwargs.get("multiple_of", 1)))
        return own_checkpointing(self.step.model, self.recomputed)

    def no_fit(self, plain_error: NoBatchFitsError, checkpoint_error: NoBatchFitsError | None, allowed: bool):
        """The NoBatchFitsError for "not even batch 1", with both attempts' figures; where
        checkpointing was not allowed, advice to allow it (accumulation cannot go below batch 1)."""
        if not allowed:
            smallest = plain_error.batch_size
            return self._attempts_error(plain_error, (
                f"Not even batch {smallest} fits in one step, so gradient accumulation cannot help (no micro-batch is "
                "smaller), and activation checkpointing was not tried (allow_checkpointing=False): allow it "
                "(allow_checkpointing=True) to recompute the repeated blocks' activations in backward instead of "
                f"keeping them; or try {self._other_options(checkpointing=False)}."))
        if checkpoint_error is None:  # nothing to wrap
            return self._attempts_error(
                plain_error,
                f"autobatch's activation checkpointing wrapped no block: {no_blocks_hint(self.step.model, self.targets, self.recomputed)}. "
                f"Else try {self._other_options()}.",
            )
        modules = self.handle.modules if self.handle is not None else []
        finer = finer_blocks_hint(self.step.model, modules)  # stages wrapped whole: name their blocks
        return self._attempts_error(
            checkpoint_error,
            f"This is with activation checkpointing of {counted(len(modules), 'block')} "
            f"({short_list(modules)}); without it batch {plain_error.batch_size} peaked at "
            f"{format_bytes(plain_error.peak_bytes)} before failing.{finer} "
            f"{'Else try' if finer else 'Try'} {self._other_options()}.",
        )

    @staticmethod
    def failed_peak(error: NoBatchFitsError, checkpointing_tried: bool) -> str:
        """The figures of a batch that ran out of memory, for "it does not fit in one step": the peak it
        reached before an allocation failed, and the request that failed where its message says. Why:
        "(plainly it peaked at 96.02 KiB)" under a 100 KiB cap read as "it fits"."""
        if not error.peak_bytes:
            return ""
        request = requested_bytes(error.last_error)
        failed = f"a request for {format_bytes(request)} more" if request else "an allocation"
        cap = f" of the {format_bytes(error.capacity_bytes)} limit" if error.capacity_bytes else ""
        return (f" ({'without it, ' if checkpointing_tried else ''}batch {error.batch_size} had reached "
                f"{format_bytes(error.peak_bytes)}{cap} when {failed} failed)")

    def no_block_why(self) -> str:
        """Why checkpointing wrapped nothing: the model checkpoints its own blocks (it read "no block to
        checkpoint was found" though its blocks were there), or no block was found, and what to name."""
        hint = no_blocks_hint(self.step.model, self.targets, self.recomputed)
        return hint if own_checkpointing(self.step.model, self.recomputed) else f"no block to checkpoint was found in the model ({hint})"

    def accumulation_hint(self, boundary: int, checkpointing: bool, unhelped: str | None = None) -> str:
        """The hint where micro-batches fit alone (up to ``boundary`` in one step) but none beside the first one's
        gradients; ``unhelped``: why activation checkpointing, tried after, did not help (no block found to wrap,
        a model that checkpoints itself, not even the smallest batch with it). A model whose blocks are attributes,
        not in a container, was told only "try lower precision ... a larger memory_limit", never which
        ``checkpoint_targets`` would have let checkpointing fit it."""
        tried = " with activation checkpointing" if checkpointing else ""
        unhelped = f" Activation checkpointing could not help: {unhelped}." if unhelped else ""
        finer = finer_blocks_hint(self.step.model, self.handle.modules) if checkpointing and self.handle else ""
        why = ("the first micro-batch's gradients stay alive through the next one's step and no micro-batch fits beside them"
               if not has_sparse_gradients(self.step) else  # probed over the plan's every micro-batch
               "the sparse gradients (a sparse=True embedding's, SparseAdam's) grow by every micro-batch's rows, torch "
               "adding them uncoalesced, and no micro-batch size holds the whole global batch's: a smaller global_batch, "
               "or sparse=False (a gradient of the table's size) may fit")
        return (f"up to {boundary} fits in one step{tried}, but not the global batch; with accumulation {why}."
                f"{unhelped}{finer} {'Else try' if finer else 'Try'} {self._other_options()}.")

    def _other_options(self, checkpointing: bool = True) -> str:
        """What is left to try when nothing fits: a smaller ``multiple_of`` where one set the
        smallest micro-batch (a plan at multiple_of=8 that checkpointing could not fit never tried
        batch 1 to 7, and its hint did not say so); lower precision only where the step is not
        already under fp16/bf16 autocast; checkpointing where it was not allowed (and
        ``checkpointing``: the hint does not name it already); first, where checkpointing was tried on a
        model that builds a key/value cache in training, turning that cache off (:func:`.own_checkpointing.cache_note`). That a model which
        checkpoints itself got no second checkpointing is the hint's own (:func:`.no_blocks_hint`), which every
        error of such a model holds (nothing is wrapped): this list said it again, in other words."""
        multiple_of = self.probe_kwargs.get("multiple_of", 1)
        lower = f"a multiple_of below {multiple_of} (no smaller micro-batch was tried), " if multiple_of > 1 else ""
        precision = "" if self.step.autocast_dtype is not None else "lower precision (bf16/fp16 autocast), "
        allow = "activation checkpointing (allow_checkpointing=True), " if checkpointing and not self.allow_checkpointing else ""
        wrapped = self.handle is not None and self.handle.modules
        cache = ("model.config.use_cache = False (its key/value cache, built in training, holds what checkpointing "
                 "frees), " if wrapped and cache_note(self.step.model, self.cache) else "")
        return (f"{cache}{allow}{lower}{precision}a smaller model or sequence length, an optimizer with less state, or a "
                "larger memory_limit / device")

    def _attempts_error(self, source: NoBatchFitsError, hint: str) -> NoBatchFitsError:
        """``source``'s figures with a new hint, carrying every probe attempt in ``attempts``; where its smallest
        batch ran out of memory inside ``optimizer.step()`` of a foreach optimizer, the hint names that first."""
        if source.batch_size in getattr(self.step, "optimizer_ooms", ()):
            hint = foreach_note(self.step.optimizer, source.batch_size) + hint
        error = NoBatchFitsError(
            batch_size=source.batch_size,
            capacity_bytes=source.capacity_bytes,
            peak_bytes=source.peak_bytes,
            device=source.device,
            last_error=source.last_error,
            hint=hint,
            diagnostics=source.diagnostics,
        )
        error.attempts = self.probes
        return error

    def recompute_note(self, exc: BaseException) -> None:
        """Where a checkpointed probe failed with torch's ``CheckpointError`` (the recompute did not run
        as the forward did), a note on ``exc`` naming autobatch's checkpointing and what to change: the
        error named neither (torch's text reads as the user's own checkpointing gone wrong). Where it
        failed as a block wrote its input in place, :meth:`in_place_note`; any other error is left as is."""
        modules = self.handle.modules if self.handle is not None else []
        if not isinstance(exc, CheckpointError):
            if "modified by an inplace operation" in str(exc):
                self.in_place_note(exc, modules)
            return
        add_note(exc, f"autobatch: this came from plan()'s activation checkpointing of {counted(len(modules), 'block')} "
                      f"({short_list(modules)}): a block's forward ran otherwise when recomputed in backward (it writes "
                      "state it then reads, such as a key/value cache passed in: model.config.use_cache = False, or "
                      "branches on it). Name other blocks in checkpoint_targets, checkpoint them your own way "
                      "(Transformers: model.gradient_checkpointing_enable()), or plan with allow_checkpointing=False")

    def in_place_note(self, exc: BaseException, modules: list[str]) -> None:
        """A note for autograd's "modified by an inplace operation" from a checkpointed probe: a wrapped
        block wrote its input in place (``nn.ReLU(inplace=True)`` first in it), which the plain model
        trains with, yet the recompute in backward reads that input again, changed. Blocks that start so
        made ``plan()`` fail, where batch 1 needed checkpointing, with autograd's text alone."""
        layers = [first for first in map(self._first_layer, modules) if first is not None]
        found = f"; their first layer is in place: {short_list(layers)}" if layers else ""
        add_note(exc, f"autobatch: this came from plan()'s activation checkpointing of {counted(len(modules), 'block')} "
                      f"({short_list(modules)}){found}. A block that writes its input in place (inplace=True on its "
                      "first layer, or x.add_(...) on it) cannot be recomputed in backward: it would read the input "
                      "changed. Make that op not in-place (inplace=False), name other blocks in checkpoint_targets, "
                      "or plan with allow_checkpointing=False")

    def _first_layer(self, name: str) -> str | None:
        """The name of block ``name``'s first layer (in registration order) where it is ``inplace=True``."""
        block = self.step.model.get_submodule(name)
        inner, layer = next(((inner, layer) for inner, layer in block.named_modules() if not list(layer.children())), ("", block))
        return (f"{name}.{inner}" if inner else name) if getattr(layer, "inplace", False) is True else None
