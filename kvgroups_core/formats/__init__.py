"""Engine KV formats: the catalogue, engine readers, detection, layout and segment runs."""
