"""The lowerings of the JAX backend: each turns one kernel group's transfer into device code."""
