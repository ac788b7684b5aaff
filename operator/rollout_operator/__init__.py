"""The control plane of elastic-rollout: the `rolloutctl` CLI, the kopf operator, the planner loop and
`rolloutctl run`."""
