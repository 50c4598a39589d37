"""The checkify report of out-of-range traced block ids, at no cost outside checkify.

The kernels drop an item whose id is outside ``[0, num_blocks)`` whatever happens here; this
module only makes ``jax.experimental.checkify`` name the first bad id. ``checkify.debug_check``
would do that too, but it puts an error effect on every program that contains it, and a jitted
function with effects leaves JAX's C++ dispatch path, and an engine step's host dispatch then
costs more than the transfer itself (docs/PERFORMANCE.md, "Measurements behind the design").

So the check is a primitive of its own, :data:`block_ids_check_p`: an identity on the ids with
no effect (plain ``jit`` lowers it to nothing and keeps the fast path), and a checkify rule that
adds the error only when a program is checkified, the way JAX's own index and division checks
are added. The rule uses checkify's rule table (``jax._src.checkify``); where a JAX release
lacks it, :func:`check_block_ids` falls back to ``debug_check`` (correct, slower dispatch) and
:data:`EFFECT_FREE` says so.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jax.interpreters import mlir

try:  # checkify's rule table and error class (internal; the calling convention is read below)
    import inspect

    from jax._src import checkify as _checkify_internals
    from jax._src.core import Primitive
    from jax._src.interpreters import batching

    _RULES = _checkify_internals.error_checks
    _UNMAPPED = getattr(batching, "not_mapped", None)  # how a batching rule says "unbatched"
    _assert_func = _checkify_internals.assert_func
    _Error = _checkify_internals.Error
    _FailedCheckError = _checkify_internals.FailedCheckError
    _traceback = _checkify_internals.get_traceback
    # Releases differ in what a rule returns ((error, out) or (out, error)) and in the
    # arguments passed before the primitive's inputs: the return order is read from the
    # interpreter's call of the rules (default: error first, as JAX 0.4-0.10 do).
    try:
        _OUT_FIRST = "outvals, error = checkify_rule(" in inspect.getsource(
            _checkify_internals.checkify_jaxpr_flat
        )
    except (OSError, TypeError, AttributeError):  # no source: the long-standing order
        _OUT_FIRST = False
    EFFECT_FREE = True
except (ImportError, AttributeError):  # pragma: no cover - depends on the JAX release
    EFFECT_FREE = False


def _message(num_blocks: int, kernel_group: int) -> str:
    return (
        f"block_ids: expected ids in [0, {num_blocks}) for kernel group {kernel_group}, "
        "got {} (its item moved nothing)"
    )


def _bad_ids(ids, meta, *, num_blocks: int, kept: int, blocks_per_chunk: int, grid_items: int):
    """``(any bad, first bad id)`` over the items ``[meta[0], meta[0] + meta[1])`` a group
    moves; ``ids`` ``[..., n]`` and ``meta`` ``[..., 2]`` may carry leading (vmapped) axes."""
    lead = np.broadcast_shapes(ids.shape[:-1], meta.shape[:-1])
    ids = jnp.broadcast_to(ids, lead + ids.shape[-1:])
    meta = jnp.broadcast_to(meta, lead + (2,))
    i = jnp.arange(grid_items, dtype=jnp.int32)
    item = meta[..., :1] + i
    chunk = item // kept
    where = jnp.clip(
        chunk * blocks_per_chunk + (blocks_per_chunk - kept) + item % kept, 0, ids.shape[-1] - 1
    )
    used = jnp.take_along_axis(ids, where, axis=-1)
    bad = (i < meta[..., 1:]) & ((used < 0) | (used >= num_blocks))
    flat_bad, flat_used = bad.reshape(-1), used.reshape(-1)
    return jnp.any(flat_bad), flat_used[jnp.argmax(flat_bad)]


if EFFECT_FREE:
    block_ids_check_p = Primitive("kvgroups_block_ids_check")

    @block_ids_check_p.def_impl
    def _impl(ids, meta, **_):
        return ids

    @block_ids_check_p.def_abstract_eval
    def _abstract(ids, meta, **_):
        return ids

    mlir.register_lowering(block_ids_check_p, lambda ctx, ids, meta, **_: [ids])

    def _batch(args, dims, **params):
        ids, meta = args
        ids_dim, meta_dim = dims
        if ids_dim is not _UNMAPPED:
            ids = jnp.moveaxis(ids, ids_dim, 0)
        if meta_dim is not _UNMAPPED:
            meta = jnp.moveaxis(meta, meta_dim, 0)
            if ids_dim is _UNMAPPED:
                # The check needs one leading axis on both; the ids stay unbatched outside.
                out = block_ids_check_p.bind(
                    jnp.broadcast_to(ids, meta.shape[:1] + ids.shape), meta, **params
                )
                return out[0], _UNMAPPED
        return block_ids_check_p.bind(
            ids, meta, **params
        ), 0 if ids_dim is not _UNMAPPED else _UNMAPPED

    batching.primitive_batchers[block_ids_check_p] = _batch

    def _checkify_rule(*args, num_blocks, kept, blocks_per_chunk, grid_items, kernel_group):
        # The error, the enabled set, then the primitive's inputs (ids, meta); JAX 0.11 passes
        # a checkify context before them, and its assert_func takes that context first too.
        at = next(i for i, a in enumerate(args) if isinstance(a, _Error))
        error, enabled_errors, lead = args[at], args[at + 1], args[:at]
        ids, meta = args[-2:]
        if _FailedCheckError in enabled_errors:
            any_bad, first = _bad_ids(
                ids,
                meta,
                num_blocks=num_blocks,
                kept=kept,
                blocks_per_chunk=blocks_per_chunk,
                grid_items=grid_items,
            )
            error = _assert_func(
                *lead,
                error,
                any_bad,
                _FailedCheckError(_traceback(), _message(num_blocks, kernel_group), first),
            )
        return (ids, error) if _OUT_FIRST else (error, ids)

    _RULES[block_ids_check_p] = _checkify_rule


def check_block_ids(
    ids: Any,
    meta: Any,
    *,
    num_blocks: int,
    kept: int,
    blocks_per_chunk: int,
    grid_items: int,
    kernel_group: int,
) -> Any:
    """``ids``, marked for checkify: under ``checkify.checkify`` a moved item (of the
    ``meta = [first_item, num_items]`` range) whose id is outside ``[0, num_blocks)`` fails
    with the first such id; without checkify nothing runs. Use the returned array."""
    params = dict(
        num_blocks=int(num_blocks),
        kept=int(kept),
        blocks_per_chunk=int(blocks_per_chunk),
        grid_items=int(grid_items),
        kernel_group=int(kernel_group),
    )
    if EFFECT_FREE:
        return block_ids_check_p.bind(ids, jnp.asarray(meta), **params)
    any_bad, first = _bad_ids(
        ids, jnp.asarray(meta), **{k: v for k, v in params.items() if k != "kernel_group"}
    )
    checkify.debug_check(jnp.logical_not(any_bad), _message(num_blocks, kernel_group), first)
    return ids


__all__ = ["EFFECT_FREE", "check_block_ids"]
