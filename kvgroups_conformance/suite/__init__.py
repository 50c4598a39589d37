"""The conformance cases the kit's plugin runs against a backend."""
