"""Tensors: the framework-free dtypes, tensor descriptors, and the array registry (which
backend handles an array, found without importing its framework; ``describe``)."""
