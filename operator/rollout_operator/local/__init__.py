"""rolloutctl run: a whole RolloutJob on one machine, each pod as local processes (engine + sidecar)."""
