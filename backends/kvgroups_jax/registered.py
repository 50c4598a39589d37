"""The JAX backend's registered variants (entry points of the ``kvgroups.backends`` group).

They are chosen by name (``backend="jax-tpu"``), never by array type: plain ``jax.Array`` s
find ``"jax"`` (``lowering="auto"``).

- ``jax-tpu``: the TPU kernels (``lowering="tpu"``) on whatever platform the call is traced
  for, so a function calling ``store`` / ``load`` with it and lowered with
  ``lowering_platforms=("tpu",)`` on any machine holds the Mosaic TPU custom calls;
- ``jax-tpu-interpret``: the same kernels in Pallas' TPU interpret mode, on any platform
  (``python -m kvgroups_conformance --backend jax-tpu-interpret`` certifies them on a CPU).
"""

from __future__ import annotations

from .backend import JaxBackend


def jax_tpu() -> JaxBackend:
    return JaxBackend(lowering="tpu")


def jax_tpu_interpret() -> JaxBackend:
    return JaxBackend(lowering="tpu-interpret")


__all__ = ["jax_tpu", "jax_tpu_interpret"]
