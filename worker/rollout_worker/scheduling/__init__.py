"""Torch-free arithmetic the engine, the planner and the simulator share: layouts, the KV page allocator, the
prefix cache, admission and retraction, which heads each shard owns, and the reconfiguration cost."""
