"""A rank process: its step loop and state, replicas and their scheduling, reconfiguration, migration, weight
sync, sampling."""
