"""Run state: the configuration, the capture contract, the witness and checkpoints, servable layers, prepared data, durable writes, and the run directory's records."""
