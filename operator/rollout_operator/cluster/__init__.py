"""The operator on a cluster, pure parts: settings, manifests, checks and plans, reconciliation. No kopf."""
