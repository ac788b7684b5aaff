"""Wire contracts, torch-free: SGLang's bodies, the engine's requests and sampling, the planner's state and
plans, the sidecar's bodies, weight-update formats."""
