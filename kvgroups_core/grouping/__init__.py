"""Grouping: layers grouped by identity, engine groups, attention windows, tensor-parallel
shards, the manager, and the shape-spec strings."""
