"""What XLA's partitioner cannot do alone: ring attention (shard_map over `sequence`)."""
