"""Engine KV formats: the catalogue, the readers of each engine's structure, detection, the
per-layer byte layout, and contiguous segment runs."""
