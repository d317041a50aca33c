"""The phases of one training step, in order: where an out-of-memory error can strike.

Fault injection names them, the runner reports them, and ranks vote on them when a step
fails on one rank (see :mod:`autobatch.dist.step`).
"""

PHASES: tuple[str, ...] = ("transfer", "forward", "backward", "optimizer")
