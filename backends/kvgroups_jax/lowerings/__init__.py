"""The copy programs a JAX transfer lowers to, one module per lowering, and their choice.

``cuda``, ``triton``, ``mosaic``, ``xla``; ``choice`` picks one per group geometry.
"""
