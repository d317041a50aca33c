"""Planning: when the wanted global batch does not fit in one step, the fastest way to train it.

Gradient accumulation over micro-batches (:mod:`.accumulation`, the one implementation the
runner uses too), activation checkpointing of repeated blocks when not even batch 1 fits
(:mod:`.checkpointing`; the state a block's forward writes, kept across its recompute, in
:mod:`.recompute_state`), timed candidates for the throughput objective (:mod:`.throughput`)
and :func:`~autobatch.plan` itself (:mod:`.planner`; its errors when nothing fits in
:mod:`.plan_errors`, its notes on BatchNorm and spectral norm split into micro-batches in :mod:`.batch_statistics`, on models that checkpoint
themselves or keep a training cache in :mod:`.own_checkpointing`). The folder is ``planning`` rather than
``plan`` so that ``autobatch.plan`` stays the function.
"""
