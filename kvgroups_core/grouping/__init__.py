"""Grouping: kernel groups by identity, engine groups, windows, TP shards, manager, shape specs."""
