"""Simulation: workloads, the step-level pod simulator, the policies, the oracles and bounds, the reports
and the planner benchmark. Imports only ``rollout_worker.api`` from the worker; never torch."""
