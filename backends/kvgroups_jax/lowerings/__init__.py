"""The copy programs a JAX transfer lowers to, one module per lowering (``cuda``, ``triton``,
``mosaic``, ``xla``), and the choice between them (``choice``)."""
