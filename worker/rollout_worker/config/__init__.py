"""Settings and shapes, torch-free: the engine's settings and shape, settings from the environment, a
model's config, the presets' names."""
