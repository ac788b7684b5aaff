"""The pod sidecar: drives its share of a job through the engine's HTTP API, writes every sample once."""
