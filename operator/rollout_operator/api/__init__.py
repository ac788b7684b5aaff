"""The RolloutJob resource (torch-free): its spec, loaded from YAML with errors naming path and line."""
