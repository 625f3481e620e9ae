"""A run's workdir records: its orbax checkpoints (`store`), its `config.json` checked at each
start (`run_config`), and the parameters alone restored from a checkpoint (`parameters`)."""
