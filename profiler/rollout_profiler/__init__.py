"""Offline profiles, the profile database, the latency model, the predictor, the planner and the simulator."""
