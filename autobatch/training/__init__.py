"""Training: the runner that survives out-of-memory errors without losing a sample.

The step loop (:mod:`.runner`), its recovery (:mod:`.recovery`, :mod:`.step_guard`,
:mod:`.growth`), checkpoints and exact resume (:mod:`.resume`, :mod:`.checkpoint_io`),
cache hygiene, progress, fault injection and the run's record. Across ranks it steps
through :mod:`.ranks`. The folder is ``training`` rather than ``train`` so that
``autobatch.train`` stays the function.
"""
