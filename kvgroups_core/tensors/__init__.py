"""Tensors: dtypes, descriptors and the array registry (framework detection, describe)."""
