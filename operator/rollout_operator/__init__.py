"""The control plane of elastic-rollout: the `rolloutctl` CLI (and, later, the kopf operator)."""
