"""The elastic-rollout worker: a tensor-parallel decode engine whose layout can change mid-generation."""

__version__ = "0.1.0"
