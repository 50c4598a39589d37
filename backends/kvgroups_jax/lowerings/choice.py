"""The choice of lowering: which copy program runs a group geometry on a platform.

``cuda``, ``triton``, ``mosaic``, ``xla``, ``tpu`` or the Pallas interpret modes (``interpret``,
``tpu-interpret``): ``"auto"`` picks the fastest that can, and explicit requests that cannot run
are refused.
"""

from __future__ import annotations

import jax

from kvgroups_core.errors import KVGroupsValueError, UnsupportedConfigError
from kvgroups_jax.geometry import GroupGeometry, check_kernel_limits

LOWERINGS = ("auto", "cuda", "triton", "mosaic", "xla", "interpret", "tpu", "tpu-interpret")

#: The platform ``execute_plan`` reports for a ``"tpu"`` call traced inside a transformation:
#: the caller may lower the trace for a TPU on any machine (``lowering_platforms=("tpu",)``).
TRACED = "traced"


def _compute_capability() -> tuple[int, int]:
    cc = getattr(jax.devices()[0], "compute_capability", "0.0")
    major, _, minor = str(cc).partition(".")
    return int(major), int(minor or 0)


def resolve_lowering(requested: str, geom: GroupGeometry, platform: str) -> str:
    """The lowering that runs ``geom`` on ``platform`` (``"auto"`` picks the fastest that can).

    Explicit requests that cannot run raise :class:`UnsupportedConfigError`.
    """
    if requested not in LOWERINGS:
        raise KVGroupsValueError(f"lowering: expected one of {LOWERINGS}, got {requested!r}")
    if requested in ("xla",):
        return requested
    if requested == "interpret":
        check_kernel_limits(geom)
        return requested
    if requested in ("tpu", "tpu-interpret") or (requested == "auto" and platform == "tpu"):
        return _resolve_tpu(requested, geom, platform)
    gpu = platform in ("gpu", "cuda")
    if requested in ("cuda", "triton", "mosaic") and not gpu:
        raise UnsupportedConfigError(
            f"lowering: {requested!r} needs a CUDA GPU, got platform {platform!r}"
        )
    if requested == "triton":
        check_kernel_limits(geom)
        return requested
    if requested == "mosaic":
        _check_mosaic(geom)
        return requested
    if requested == "cuda":
        from .cuda import unsupported_reason

        reason = unsupported_reason(geom)
        if reason:
            raise UnsupportedConfigError(reason)
        return requested
    if not gpu:
        return "xla"
    # Hopper and newer on jax >= 0.11 (where the Triton lowering is deprecated and warns on
    # every call): Mosaic GPU for spans of >= 16 KiB, where it matches Triton; small pages stay
    # on Triton, where Mosaic's one serial TMA round trip per program is far slower
    # (docs/PERFORMANCE.md). Triton covers every other layout.
    if _prefers_mosaic(geom):
        return "mosaic"
    try:
        check_kernel_limits(geom)
        return "triton"
    except UnsupportedConfigError:
        return "xla"


def _resolve_tpu(requested: str, geom: GroupGeometry, platform: str) -> str:
    """The TPU lowerings: ``"tpu"`` where the program is lowered for a TPU (a TPU device, or a
    trace whose lowering platform the caller chooses), ``"tpu-interpret"`` anywhere;
    ``"auto"`` on a TPU takes ``"tpu"`` where a DMA plan fits, else XLA."""
    from .tpu import check_supported

    if requested == "tpu" and platform not in ("tpu", TRACED):
        raise UnsupportedConfigError(
            f"lowering: 'tpu' compiles for a TPU, got platform {platform!r} (use "
            "'tpu-interpret' to run the TPU kernels here, or trace the call inside jax.jit "
            "and lower it with lowering_platforms=('tpu',))"
        )
    try:
        check_supported(geom)
    except UnsupportedConfigError:
        if requested == "auto":
            return "xla"
        raise
    return "tpu" if requested == "auto" else requested


#: Smallest block-plane span (bytes) the automatic choice hands to Mosaic GPU.
MOSAIC_MIN_SPAN_BYTES = 16384


def _jax_version() -> tuple[int, int]:
    major, minor = jax.__version__.split(".")[:2]
    return int(major), int(minor)


def _prefers_mosaic(geom: GroupGeometry) -> bool:
    if _jax_version() < (0, 11) or geom.span is None:
        return False
    if geom.span * geom.unit < MOSAIC_MIN_SPAN_BYTES:
        return False
    try:
        _check_mosaic(geom)
    except UnsupportedConfigError:
        return False
    return True


def _check_mosaic(geom: GroupGeometry) -> None:
    from .mosaic import mosaic_pieces

    check_kernel_limits(geom)
    if _compute_capability() < (9, 0):
        raise UnsupportedConfigError(
            f"lowering: Mosaic GPU needs compute capability >= 9.0, got {_compute_capability()}"
        )
    mosaic_pieces(geom)
