"""One bench kit per runtime (``numpy_kit``, ``torch_kit``, ``jax_kit``), loaded by name by
:func:`kvgroups_tools.bench.load_kit` only when that runtime is asked for."""
