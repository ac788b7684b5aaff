"""The operator against the Kubernetes API: kopf handlers, the API client, per-job runtime, metrics."""
