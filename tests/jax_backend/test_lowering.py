import importlib.util
from unittest import mock

import jax
import jax.numpy as jnp
import pytest
from kvgroups_jax import executor
from kvgroups_jax.lowerings import choice as lowering_choice

from kvgroups_core.errors import UnsupportedConfigError
from tests.support.jax_layouts import LAYOUTS, make_group, make_plan

needs_absl = pytest.mark.skipif(
    importlib.util.find_spec("absl") is None,
    reason="Mosaic GPU lowering imports absl: pip install absl-py",
)

MOSAIC_LAYOUTS = ("nhd", "flashinfer_nhd", "cross_layer")


def _lower(layout, direction, lowering, dtype="bfloat16"):
    # A Llama-like page (16 tokens x 8 heads x 128) so boxes hit the real 4096 / TMA limits.
    arrays, g = make_group(
        layout,
        dtype,
        nb=32,
        bs=16,
        nh=8,
        hs=128,
        num_chunks=2,
        bpc=4,
        first_item=1 if direction == "load" else 0,
    )
    nbytes = g.num_planes * g.slots * g.row_bytes
    plan = make_plan(direction, [g], arrays, [nbytes])
    caches = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    objects = [jax.ShapeDtypeStruct((2, nbytes), jnp.uint8)]
    # An abstract H200: compute capability 9.0, no GPU needed.
    with mock.patch.object(lowering_choice, "_compute_capability", return_value=(9, 0)):
        return executor.lower_plan(plan, lowering, caches, objects).as_text()


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_lowering_accepts_every_layout(layout, direction):
    text = _lower(layout, direction, "triton")
    assert "__gpu$xla.gpu.triton" in text
    assert f"kvgroups_{direction}_pages" in text


def _assert_mosaic_in_place(text, direction, layout):
    # One Mosaic GPU custom call (not Triton) per group, aliasing what it writes.
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert calls and all("@mosaic_gpu" in c for c in calls), calls
    assert "triton" not in text
    assert all("output_operand_aliases = [#stablehlo.output_operand_alias" in c for c in calls)
    # The donated arguments (caches on load, the object on store) alias the results.
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    n_caches = 1 if layout == "cross_layer" else 2
    assert main.count("tf.aliasing_output") == (n_caches if direction == "load" else 1)


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("layout", MOSAIC_LAYOUTS)
@needs_absl
def test_mosaic_lowering_accepts_contiguous_layouts(layout, direction):
    _assert_mosaic_in_place(_lower(layout, direction, "mosaic"), direction, layout)


@pytest.mark.parametrize("layout", sorted(set(LAYOUTS) - set(MOSAIC_LAYOUTS)))
@needs_absl
def test_mosaic_refuses_strided_layouts_with_unsupported_config(layout):
    with pytest.raises(UnsupportedConfigError, match="contiguous span"):
        _lower(layout, "store", "mosaic")


@needs_absl
def test_fp8_and_fp32_lower_for_both_gpu_paths():
    for dtype in ("float8_e4m3fn", "float32"):
        assert "triton" in _lower("interleaved", "load", "triton", dtype)
        _assert_mosaic_in_place(_lower("nhd", "store", "mosaic", dtype), "store", "nhd")


def test_a_non_power_of_two_box_is_rejected_by_the_triton_lowering():
    from kvgroups_jax import geometry

    # Forcing 3-element boxes must trip Triton's power-of-two check at lowering time.
    real = geometry.pow2_parts
    with (
        mock.patch.object(geometry, "pow2_parts", lambda n, cap: [(0, n)]),
        pytest.raises(Exception, match="power of 2|power-of-two|power of two"),
    ):
        arrays, g = make_group("nhd", "bfloat16", nh=3, hs=1, nb=8, bs=1, num_chunks=1, bpc=1)
        plan = make_plan("store", [g], arrays, [g.num_planes * g.slots * g.row_bytes])
        caches = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
        objs = [jax.ShapeDtypeStruct((1, g.num_planes * g.slots * g.row_bytes), jnp.uint8)]
        executor.lower_plan(plan, "triton", caches, objs)
    assert geometry.pow2_parts is real


def _mosaic_kernel_text(lowered):
    """The Mosaic GPU kernel module inside a lowered program, as MLIR text."""
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib import mosaic_gpu_dialect
    from jax._src.lib.mlir import ir

    module = lowered.compiler_ir("stablehlo")
    calls = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if inner.operation.name == "stablehlo.custom_call":
                        calls.append(inner)
                    walk(inner.operation)

    with module.context:
        walk(module.operation)
        (call,) = calls
        config = ir.DictAttr(call.attributes["mhlo.backend_config"])
        raw = bytes(ir.StringAttr(config["module"]).value_bytes)
    with jax_mlir.make_ir_context() as ctx:
        mosaic_gpu_dialect.register_dialect(ctx)
        ctx.allow_unregistered_dialects = True
        return str(ir.Module.parse(raw))


@needs_absl
@pytest.mark.parametrize("direction", ["store", "load"])
def test_mosaic_kernel_uses_bulk_copies_without_tensor_maps(direction):
    # Every operand a tensor-map copy reads needs a TMA descriptor built on the host at each
    # launch, and the compile time grows with their number (docs/PERFORMANCE.md).
    # Contiguous spans need none: both directions must be plain cp.async.bulk copies.
    arrays, g = make_group("nhd", "bfloat16", nb=32, bs=16, nh=8, hs=128, num_chunks=2, bpc=4)
    nbytes = g.num_planes * g.slots * g.row_bytes
    plan = make_plan(direction, [g], arrays, [nbytes])
    caches = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    objs = [jax.ShapeDtypeStruct((2, nbytes), jnp.uint8)]
    with mock.patch.object(lowering_choice, "_compute_capability", return_value=(9, 0)):
        text = _mosaic_kernel_text(executor.lower_plan(plan, "mosaic", caches, objs))
    assert "cp.async.bulk.tensor" not in text
    assert "call @mosaic_gpu_init_tma_desc" not in text
    assert "cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes" in text  # GMEM->SMEM
    assert "cp.async.bulk.global.shared::cta.bulk_group" in text  # SMEM->GMEM


def _geom(layout, nh, hs):
    from kvgroups_jax.geometry import group_geometry

    arrays, g = make_group(layout, "bfloat16", nb=32, bs=16, nh=nh, hs=hs, num_chunks=1, bpc=2)
    return group_geometry(
        g,
        [a for a in make_plan("store", [g], arrays, [1]).tensor_specs],
        g.num_planes * g.slots * g.row_bytes,
    )


@pytest.mark.parametrize(
    ("version", "cc", "layout", "nh", "hs", "expected"),
    [
        ((0, 11), (9, 0), "nhd", 8, 128, "mosaic"),  # 32 KiB contiguous pages on Hopper
        ((0, 11), (9, 0), "nhd", 1, 64, "triton"),  # 2 KiB pages: Triton was faster
        ((0, 11), (9, 0), "hnd", 8, 128, "triton"),  # strided pages: Mosaic cannot
        ((0, 11), (8, 0), "nhd", 8, 128, "triton"),  # Ampere: no TMA
        ((0, 10), (9, 0), "nhd", 8, 128, "triton"),  # Triton not yet deprecated
    ],
)
def test_auto_lowering_choice(version, cc, layout, nh, hs, expected):
    geom = _geom(layout, nh, hs)
    with (
        mock.patch.object(lowering_choice, "_compute_capability", return_value=cc),
        mock.patch.object(lowering_choice, "_jax_version", return_value=version),
    ):
        assert lowering_choice.resolve_lowering("auto", geom, "gpu") == expected
        assert lowering_choice.resolve_lowering("auto", geom, "cpu") == "xla"


def test_triton_warps_follow_the_box_size():
    from kvgroups_jax.lowerings.triton import default_warps

    assert default_warps(_geom("nhd", 8, 128)) == 8  # one 32 KiB box per page
    assert default_warps(_geom("nhd", 1, 64)) == 4  # 2 KiB pages


def _lower_fresh_store(layout, lowering):
    arrays, g = make_group(layout, "bfloat16", nb=32, bs=16, nh=8, hs=128, num_chunks=2, bpc=4)
    nbytes = g.num_planes * g.slots * g.row_bytes
    plan = make_plan("store", [g], arrays, [nbytes])
    caches = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    with mock.patch.object(lowering_choice, "_compute_capability", return_value=(9, 0)):
        return executor.lower_plan(plan, lowering, caches, [None]).as_text()


def _assert_object_is_a_kernel_output(text, marker):
    # No object argument, no zero-filled buffer, no aliasing: the kernel's result is the object.
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert calls and all(marker in c for c in calls), calls
    assert not any("output_operand_aliases = [#stablehlo.output_operand_alias" in c for c in calls)
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert "tf.aliasing_output" not in main and "ui8" not in main.split("->")[0]
    assert "stablehlo.broadcast_in_dim" not in text


def test_triton_store_without_objects_makes_the_object_the_kernel_output():
    _assert_object_is_a_kernel_output(_lower_fresh_store("nhd", "triton"), "__gpu$xla.gpu.triton")


@needs_absl
def test_mosaic_store_without_objects_makes_the_object_the_kernel_output():
    _assert_object_is_a_kernel_output(_lower_fresh_store("nhd", "mosaic"), "@mosaic_gpu")


@pytest.mark.parametrize(
    ("layout", "lowering"),
    [
        *(
            (layout, lowering)
            for layout in ("nhd", "hnd", "cross_layer")
            for lowering in ("triton", "xla")
        ),
        *(pytest.param(layout, "mosaic", marks=needs_absl) for layout in ("nhd", "cross_layer")),
    ],
)
def test_load_hands_back_caches_behind_a_barrier_of_their_own_types(layout, lowering):
    # The kernels write flat integer views; without the barrier XLA folds the views' bitcasts
    # into the caller's fusions, which then read the flat buffer (slower). The
    # caches leave the load as arrays of their own shape and dtype, through one barrier.
    arrays, _ = make_group(layout, "bfloat16", nb=32, bs=16, nh=8, hs=128)
    text = _lower(layout, "load", lowering)
    barriers = [line for line in text.splitlines() if "stablehlo.optimization_barrier" in line]
    assert len(barriers) == 1, barriers
    shapes = ["tensor<%sxbf16>" % "x".join(map(str, a.shape)) for a in arrays]
    assert barriers[0].rstrip().endswith(" : " + ", ".join(shapes)), (barriers[0], shapes)
    assert "optimization_barrier" not in _lower(layout, "store", lowering)
