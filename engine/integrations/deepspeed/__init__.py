"""DeepSpeed's API over the engine: ``engine.initialize``, its engine, config, reports and checkpoints."""
