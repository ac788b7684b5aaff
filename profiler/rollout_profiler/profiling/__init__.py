"""Making profiles: ``measure`` runs the real engine (the only part of ``rollout_profiler`` that may import
torch or ``rollout_worker.engine``); ``modelled`` builds profiles from published figures. This file
imports nothing, so importing ``profiling.modelled`` does not pull torch in."""
