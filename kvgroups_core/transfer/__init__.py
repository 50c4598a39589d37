"""Transfers: the backend protocol, plans and their planner, block ids, memory objects, the
checks run before any byte moves, the NumPy reference backend, tensor-parallel conversion, and
the public calls (``api``)."""
