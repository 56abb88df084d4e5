"""The offloaded optimizer: ``engine.AdamW``, gradient shards in the store, the pipelined step, loss
scaling and the durable step record."""
