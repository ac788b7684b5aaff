"""Benchmarks: the engine, the HTTP service, the planner, the simulator, memory, a peer engine and a whole
job. JSON results plus printed tables; the product never imports this package (``rolloutctl bench`` imports
it lazily)."""
