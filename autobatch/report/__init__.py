"""Reports at the edge of the pipeline: the memory-curve and sweep plots (:mod:`.plots`)."""
