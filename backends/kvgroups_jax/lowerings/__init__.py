"""The copy programs a JAX transfer lowers to, one module per lowering, and their choice.

``cuda``, ``triton``, ``mosaic``, ``xla``, ``tpu`` (with ``tpu_windows``, its DMA plans);
``choice`` picks one per group geometry.
"""
