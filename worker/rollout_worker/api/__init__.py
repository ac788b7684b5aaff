"""Torch-free contracts shared by the engine, its HTTP server, the CLI, the sidecar, the planner and tests."""
