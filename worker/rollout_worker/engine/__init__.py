"""The tensor-parallel engine: model, sharding, KV cache, scheduling, reconfiguration, rank processes."""
