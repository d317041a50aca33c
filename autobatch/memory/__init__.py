"""Memory: the first stage of the pipeline, what every later stage measures with.

What counts as an out-of-memory error and how to free memory after one (:mod:`.oom`), byte
units (:mod:`.units`), a device's capacity, allocated and peak figures behind one interface
(:mod:`.devices`), the simulated memory-capped CPU device that lets CI exercise every
out-of-memory path (:mod:`.simulated`, :mod:`.accounting`), the workspaces math libraries
keep per thread (:mod:`.workspaces`), the figures a person reads when a batch is close
to the edge (:mod:`.diagnostics`), optimizer state an out-of-memory error interrupted while
it was being created (:mod:`.lazy_state`), state a probe created, parked in a private pool
until its optimizer's next step (:mod:`.parking`), and the caching allocator's expandable-segments
setting (:mod:`.allocator`).
"""
