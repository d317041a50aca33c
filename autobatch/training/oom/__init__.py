"""The runner's out-of-memory recovery: a transactional step, the replay in smaller micro-batches, grow-back."""
