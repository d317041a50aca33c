"""The fake-tensor estimate: a step's peak memory traced without allocating it, and the probe's use of it."""
