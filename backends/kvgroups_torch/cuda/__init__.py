"""The CUDA path of the torch backend, one module per role.

Per-GPU state, object addressing, launch state, the run loops and the replay of validated
calls, over the raw driver calls and device tables.
"""
