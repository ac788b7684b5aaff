"""Control logic shared by rolloutctl run and the operator: the planner tick, pod state, plans. No kopf."""
