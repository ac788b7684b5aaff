"""Planning: the decode-step latency model, the remaining-length predictor and the reconfiguration planner
(pure functions, no I/O; they import only ``rollout_worker.api`` from the worker)."""
