"""The runner's checkpoints: atomic writes, what they hold, and the exact resume that continues a run."""
