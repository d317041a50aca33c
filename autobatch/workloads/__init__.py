"""Built-in workloads the CLI, the benchmarks and the tests train: small models
(:mod:`.models`) and synthetic data (:mod:`.batches`)."""
