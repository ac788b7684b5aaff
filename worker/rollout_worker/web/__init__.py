"""Torch-free HTTP helpers shared by the engine's server and the pod sidecar: middleware and error bodies."""
