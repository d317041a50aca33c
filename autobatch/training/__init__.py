"""Training: the runner that survives out-of-memory errors without losing a sample.

The step loop (:mod:`.runner`), its out-of-memory recovery (:mod:`.oom`: the step guard, the
replay, grow-back, fault injection), checkpoints and exact resume (:mod:`.checkpoints`),
cache hygiene, progress and the run's record. Across ranks it steps
through :mod:`.ranks`. The folder is ``training`` rather than ``train`` so that
``autobatch.train`` stays the function.
"""
