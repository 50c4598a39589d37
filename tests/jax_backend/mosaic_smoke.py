"""GPU smoke run of the Mosaic GPU (TMA) page copy: ``python3 -m tests.jax_backend.mosaic_smoke``.

Needs a Hopper-or-newer GPU visible to JAX. Every case runs store then load through
:func:`kvgroups_jax.executor.execute_plan` with ``lowering="mosaic"``, compares every byte of
caches and objects with the NumPy reference (:func:`kvgroups_core.transfer.reference.execute_group`)
and checks that the donated buffers were written in place (same ``unsafe_buffer_pointer``,
inputs deleted). One JSON object per line on stdout; a failing case carries its full traceback
(also printed to stderr). ``--no-bench`` skips the closing bandwidth comparison with Triton.
Exit status 0 only when every check passed.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
for _p in (_ROOT, _ROOT / "backends"):  # tests.support, kvgroups_core; kvgroups_jax
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


def emit(**record) -> None:
    print(json.dumps(record, default=str), flush=True)


def environment() -> dict:
    import jax
    import jaxlib

    dev = jax.devices()[0]
    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": sys.version.split()[0],
        "platform": dev.platform,
        "device": getattr(dev, "device_kind", str(dev)),
        "compute_capability": getattr(dev, "compute_capability", None),
    }


def _nbytes(g) -> int:
    return g.num_planes * g.slots * g.row_bytes


def lowered_text_facts(plan, arrays, nbytes) -> dict:
    """What XLA compiled: the Mosaic GPU custom call, and any whole-buffer copies."""
    import jax
    import jax.numpy as jnp
    from kvgroups_jax import executor

    caches = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    objs = [jax.ShapeDtypeStruct((plan.num_chunks, nbytes), jnp.uint8)]
    compiled = executor.lower_plan(plan, "mosaic", caches, objs).compile().as_text()
    lines = compiled.splitlines()
    return {
        "mosaic_custom_calls": sum("mosaic_gpu" in ln and "custom-call" in ln for ln in lines),
        "triton_custom_calls": sum("triton" in ln and "custom-call" in ln for ln in lines),
        "hlo_copy_ops": sum(" copy(" in ln or " copy-start(" in ln for ln in lines),
    }


def run_case(name, layout, dtype, **shape) -> bool:
    import jax
    from kvgroups_jax.executor import build_program
    from kvgroups_jax.lowerings import mosaic as pallas_mosaic

    from tests.support.jax_checks import run_and_check
    from tests.support.jax_layouts import make_group, make_plan

    ok = True
    for direction in ("store", "load"):
        record = {
            "case": name,
            "layout": layout,
            "dtype": dtype,
            "direction": direction,
            **{k: v for k, v in shape.items() if k != "seed"},
        }
        try:
            gpu = jax.devices("gpu")[0]
            arrays, g = make_group(
                layout,
                dtype,
                direction=direction,
                first_item=2 if direction == "load" else 0,
                **shape,
            )
            nbytes = _nbytes(g)
            plan = make_plan(direction, [g], arrays, [nbytes])
            program, _, _ = build_program(plan, "mosaic", "gpu")
            record["pieces"] = pallas_mosaic.mosaic_pieces(program.geoms[0])
            record["items"] = int(g.num_items)
            record.update(lowered_text_facts(plan, arrays, nbytes))
            t0 = time.perf_counter()
            caches, objs, new_c, new_o, ptrs, optrs = run_and_check(
                direction, [g], arrays, [nbytes], lowering="mosaic", device=gpu
            )
            record["seconds_incl_compile"] = round(time.perf_counter() - t0, 3)
            record["bytes_equal_reference"] = True
            if direction == "load":
                record["cache_ptrs_unchanged"] = [c.unsafe_buffer_pointer() for c in new_c] == ptrs
                record["inputs_deleted"] = all(c.is_deleted() for c in caches)
            else:
                record["object_ptrs_unchanged"] = [
                    o.unsafe_buffer_pointer() for o in new_o
                ] == optrs
                record["inputs_deleted"] = all(o.is_deleted() for o in objs)
            checks = [
                record["inputs_deleted"],
                record["mosaic_custom_calls"] >= 1,
                record["triton_custom_calls"] == 0,
                record.get("cache_ptrs_unchanged", record.get("object_ptrs_unchanged")),
            ]
            record["ok"] = all(checks)
        except Exception as exc:  # report every failure, keep going
            record.update(
                ok=False,
                error=f"{type(exc).__name__}: {exc}"[:2000],
                traceback=traceback.format_exc(),
            )
            print(record["traceback"], file=sys.stderr, flush=True)
        ok = ok and record["ok"]
        emit(**record)
    return ok


def bench(layers=32, blocks=2048, pages=512, iters=20) -> None:
    """Store and load bandwidth, Mosaic vs Triton, on the JAX kernel benchmark shape: ``layers``
    arrays [2, blocks, 16, 8, 128] bf16, ``pages`` random pages; bytes read + written per
    second. The executor's jitted program is called back to back (planning excluded), each
    call's donated results feeding the next."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from kvgroups_jax import executor

    from tests.support.jax_layouts import make_plan

    for direction in ("store", "load"):
        zeros, g = _big_group(layers, blocks, pages, direction)
        nbytes = _nbytes(g)
        plan = make_plan(direction, [g], zeros, [nbytes])
        moved = 2 * g.num_items * g.num_planes * g.block_size * g.row_bytes
        for lowering in ("mosaic", "triton"):
            record = {
                "bench": direction,
                "lowering": lowering,
                "layers": layers,
                "blocks": blocks,
                "pages": pages,
                "bytes_read_plus_written": moved,
            }
            try:
                key = jax.random.key(0)
                caches = tuple(
                    lax.bitcast_convert_type(
                        jax.random.bits(jax.random.fold_in(key, i), z.shape, jnp.uint16),
                        jnp.bfloat16,
                    )
                    for i, z in enumerate(zeros)
                )
                objs = (jax.random.bits(key, (plan.num_chunks, nbytes), jnp.uint8),)
                program, metas, idss = executor.build_program(plan, lowering, "gpu")
                fn = executor._store_jit if direction == "store" else executor._load_jit
                args = (fn, program, direction, metas, idss)
                caches, objs = _step(*args, caches, objs)  # compiles
                jax.block_until_ready((caches, objs))
                t0 = time.perf_counter()
                for _ in range(iters):
                    caches, objs = _step(*args, caches, objs)
                jax.block_until_ready((caches, objs))
                per_call = (time.perf_counter() - t0) / iters
                record.update(
                    ok=True,
                    seconds_per_call=round(per_call, 6),
                    gb_per_s=round(moved / per_call / 1e9, 1),
                )
                del caches, objs
            except Exception as exc:
                record.update(
                    ok=False,
                    error=f"{type(exc).__name__}: {exc}"[:2000],
                    traceback=traceback.format_exc(),
                )
                print(record["traceback"], file=sys.stderr, flush=True)
            emit(**record)


def _step(fn, program, direction, metas, idss, caches, objs):
    """One executor program call; the donated side is replaced by the results."""
    out = fn(program, caches, objs, metas, idss)
    return (caches, out) if direction == "store" else (out, objs)


def _big_group(layers, blocks, pages, direction):
    """A Llama-like NHD group over ``layers`` zero host arrays (calloc'd, never filled: only
    their shapes are used)."""
    from unittest import mock

    import numpy as np

    from tests.support import jax_layouts as layouts

    bpc = 16
    ids = np.random.default_rng(1).permutation(blocks)[:pages]
    with mock.patch.object(
        layouts, "random_array", lambda rng, shape, dtype: np.zeros(shape, dtype)
    ):
        return layouts.make_group(
            "nhd",
            "bfloat16",
            direction=direction,
            num_chunks=pages // bpc,
            bpc=bpc,
            nl=layers,
            nb=blocks,
            bs=16,
            nh=8,
            hs=128,
            ids=ids,
        )


def main(argv) -> int:
    try:
        env = environment()
    except Exception as exc:
        emit(
            event="environment",
            ok=False,
            error=f"{type(exc).__name__}: {exc}",
            traceback=traceback.format_exc(),
        )
        return 1
    emit(event="environment", **env)
    cases = [
        # Llama-like page: 16 tokens x 8 heads x 128 (one 64-row TMA piece per plane).
        (
            "llama_nhd_bf16",
            "nhd",
            "bfloat16",
            dict(nl=4, nb=256, bs=16, nh=8, hs=128, num_chunks=4, bpc=8),
        ),
        (
            "llama_nhd_fp8",
            "nhd",
            "float8_e4m3fn",
            dict(nl=2, nb=64, bs=16, nh=8, hs=128, num_chunks=3, bpc=4),
        ),
        (
            "llama_nhd_fp32",
            "nhd",
            "float32",
            dict(nl=2, nb=64, bs=16, nh=8, hs=128, num_chunks=3, bpc=4),
        ),
        (
            "flashinfer_nhd_bf16",
            "flashinfer_nhd",
            "bfloat16",
            dict(nl=2, nb=64, bs=16, nh=8, hs=128, num_chunks=3, bpc=4),
        ),
        (
            "cross_layer_bf16",
            "cross_layer",
            "bfloat16",
            dict(nl=4, nb=64, bs=16, nh=8, hs=128, num_chunks=3, bpc=4),
        ),
        # 64-token pages (128 KiB per plane): several pieces through both shared buffers.
        (
            "big_page_nhd_bf16",
            "nhd",
            "bfloat16",
            dict(nl=2, nb=32, bs=64, nh=8, hs=128, num_chunks=2, bpc=4),
        ),
        # DeepSeek's MLA page (64 tokens x 576): 144 rows in three 48-row pieces.
        (
            "mla_like_bf16",
            "nhd",
            "bfloat16",
            dict(nl=3, nb=32, bs=64, nh=1, hs=576, num_chunks=2, bpc=4),
        ),
        # Sliding window: only the last block of each chunk is kept.
        (
            "window_nhd_bf16",
            "nhd",
            "bfloat16",
            dict(nl=2, nb=64, bs=16, nh=8, hs=128, num_chunks=3, bpc=4, kept=1),
        ),
    ]
    ok = True
    for name, layout, dtype, shape in cases:
        ok = run_case(name, layout, dtype, **shape) and ok
    if "--no-bench" not in argv:
        try:
            bench()
        except Exception as exc:
            emit(
                bench="setup",
                ok=False,
                error=f"{type(exc).__name__}: {exc}",
                traceback=traceback.format_exc(),
            )
    emit(event="summary", ok=ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
