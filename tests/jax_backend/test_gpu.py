import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvgroups_core.errors import UnsupportedConfigError
from tests.support.jax_checks import run_and_check
from tests.support.jax_layouts import LAYOUTS, make_group, make_plan

pytestmark = pytest.mark.gpu

MOSAIC_LAYOUTS = ("nhd", "flashinfer_nhd", "cross_layer")
#: Layouts whose block-planes are one contiguous span: the ones lowering "cuda" (the warp
#: kernel) takes; the others must be refused before anything moves.
CUDA_LAYOUTS = MOSAIC_LAYOUTS


def _nbytes(g):
    return g.num_planes * g.slots * g.row_bytes


@pytest.mark.parametrize("lowering", ["triton", "mosaic", "cuda", "auto"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float32"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_store_and_load_are_bit_exact_and_in_place(layout, dtype, lowering):
    if lowering == "mosaic" and layout not in MOSAIC_LAYOUTS:
        pytest.skip("Mosaic path covers contiguous layouts (others: UnsupportedConfigError)")
    gpu = jax.devices("gpu")[0]
    for direction in ("store", "load"):
        arrays, g = make_group(
            layout,
            dtype,
            nb=64,
            bs=16,
            nh=8,
            hs=128,
            num_chunks=3,
            bpc=4,
            first_item=2 if direction == "load" else 0,
        )
        if lowering == "cuda" and layout not in CUDA_LAYOUTS:
            with pytest.raises(UnsupportedConfigError, match="lowering 'cuda'"):
                run_and_check(direction, [g], arrays, [_nbytes(g)], lowering=lowering, device=gpu)
            continue
        caches, objs, new_c, new_o, ptrs, optrs = run_and_check(
            direction, [g], arrays, [_nbytes(g)], lowering=lowering, device=gpu
        )
        if direction == "load":
            assert [c.unsafe_buffer_pointer() for c in new_c] == ptrs
            assert all(c.is_deleted() for c in caches)
        else:
            assert [o.unsafe_buffer_pointer() for o in new_o] == optrs


@pytest.mark.parametrize("lowering", ["mosaic", "auto", "triton", "cuda"])
def test_gpu_mla_like_pages_in_three_pieces_are_bit_exact(lowering):
    # DeepSeek's MLA page: 64 tokens x 576 bf16 = 144 rows of 256, more than one shared
    # buffer holds, so Mosaic moves it in three 48-row pieces (not a power of two).
    from kvgroups_jax import executor
    from kvgroups_jax.lowerings import mosaic as pallas_mosaic

    gpu = jax.devices("gpu")[0]
    for direction in ("store", "load"):
        arrays, g = make_group(
            "nhd",
            "bfloat16",
            nl=3,
            nb=32,
            bs=64,
            nh=1,
            hs=576,
            num_chunks=2,
            bpc=4,
            first_item=1 if direction == "load" else 0,
        )
        if lowering == "mosaic":
            plan = make_plan(direction, [g], arrays, [_nbytes(g)])
            program = executor.build_program(plan, "mosaic", "gpu")[0]
            assert pallas_mosaic.mosaic_pieces(program.geoms[0]) == (48, 3)
        run_and_check(direction, [g], arrays, [_nbytes(g)], lowering=lowering, device=gpu)


def test_gpu_load_into_torch_cuda_caches_writes_torch_memory():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    from kvgroups_jax import JaxBackend, import_dlpack

    arrays, g = make_group("nhd", "float32", nb=64, bs=16, nh=8, hs=128, num_chunks=2, bpc=4)
    owners = [torch.from_numpy(a.copy()).cuda() for a in arrays]
    torch.cuda.synchronize()
    caches = [import_dlpack(t) for t in owners]
    plan = make_plan("load", [g], arrays, [_nbytes(g)])
    obj = jnp.asarray(
        np.random.default_rng(3).integers(0, 256, (2, _nbytes(g)), np.uint8),
        device=jax.devices("gpu")[0],
    )
    new_c, _ = JaxBackend().execute(plan, caches, [obj])
    assert [c.unsafe_buffer_pointer() for c in new_c] == [t.data_ptr() for t in owners]
    jax.block_until_ready(new_c)
    for t, c in zip(owners, new_c):
        np.testing.assert_array_equal(t.cpu().numpy().view(np.uint8), np.asarray(c).view(np.uint8))


def test_gpu_cuda_lowering_on_a_capped_grid_is_bit_exact(monkeypatch):
    # Two CTAs (16 warps) for 192 units: every warp loops over units, as a capped grid does.
    from kvgroups_jax.lowerings import cuda as cuda_copy
    from kvgroups_jax.lowerings.tuning import LoweringTuning

    monkeypatch.setattr(cuda_copy, "_num_sms", lambda: 1)
    jax.clear_caches()
    gpu = jax.devices("gpu")[0]
    try:
        for direction in ("store", "load"):
            arrays, g = make_group(
                "nhd",
                "bfloat16",
                nb=64,
                bs=16,
                nh=8,
                hs=128,
                num_chunks=3,
                bpc=4,
                first_item=2 if direction == "load" else 0,
            )
            run_and_check(
                direction,
                [g],
                arrays,
                [_nbytes(g)],
                lowering="cuda",
                device=gpu,
                tuning=LoweringTuning(resident_waves=1),
            )
    finally:
        jax.clear_caches()
