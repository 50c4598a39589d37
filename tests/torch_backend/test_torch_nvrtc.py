"""NVRTC compilation and the cubin cache: no GPU needed (CI compiles every variant)."""

import re

import pytest
from kvgroups_cuda import nvrtc
from kvgroups_cuda import params as P

from kvgroups_core.errors import CompileForbiddenError, KernelCompileError

pytest.importorskip("cuda.core")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_kernel_variant_compiles(arch):
    cubin = nvrtc.compile_cubin(arch)
    assert cubin[:4] == b"\x7fELF"
    for name in P.all_kernel_names():
        assert name.encode() + b"\0" in cubin, name


def test_source_constants_match_the_host():
    src = nvrtc.kernel_source()
    defines = dict(re.findall(r"#define (KVG_\w+) (\d+)", src))
    assert int(defines["KVG_MAX_RUNS"]) == P.MAX_RUNS
    assert int(defines["KVG_MAX_TILE"]) == P.MAX_TILE
    assert int(defines["KVG_INLINE_IDS"]) == P.INLINE_IDS
    assert int(defines["KVG_INLINE_OBJS"]) == P.INLINE_OBJS
    assert int(defines["KVG_THREADS"]) == P.THREADS
    assert int(defines["KVG_ERR_WORDS"]) == P.ERR_WORDS
    assert int(defines["KVG_WARP_UNROLL"]) == P.WARP_UNROLL  # the host sizes warp grids by it


def test_cache_key_names_version_arch_and_changes_with_the_source(monkeypatch):
    key = nvrtc.cache_key("sm_90")
    assert key.startswith(f"page_copy-{nvrtc._package_version}-sm_90-")
    assert nvrtc.cache_key("sm_80") != key
    monkeypatch.setattr(nvrtc, "kernel_source", lambda: "// changed\n")
    assert nvrtc.cache_key("sm_90") != key


def test_compiles_once_into_the_cache_then_reads_it(cubin_cache, monkeypatch):
    first = nvrtc.get_cubin("sm_80")
    path = cubin_cache / f"{nvrtc.cache_key('sm_80')}.cubin"
    assert path.read_bytes() == first

    def no_compile(arch):
        raise AssertionError("compiled although the cache holds the cubin")

    monkeypatch.setattr(nvrtc, "compile_cubin", no_compile)
    assert nvrtc.get_cubin("sm_80") == first
    assert not list(cubin_cache.glob("*.tmp"))


def test_no_compile_env_forbids_compiling_and_names_the_key(cubin_cache, monkeypatch):
    monkeypatch.setenv("KVGROUPS_NO_COMPILE", "1")
    with pytest.raises(CompileForbiddenError, match=nvrtc.cache_key("sm_90")):
        nvrtc.get_cubin("sm_90")
    assert isinstance(CompileForbiddenError("x"), KernelCompileError)


def test_no_compile_env_still_serves_cached_cubins(cubin_cache, monkeypatch):
    cubin = nvrtc.get_cubin("sm_90")
    monkeypatch.setenv("KVGROUPS_NO_COMPILE", "1")
    assert nvrtc.get_cubin("sm_90") == cubin


def test_cache_dir_defaults_to_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("KVGROUPS_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert nvrtc.cache_dir() == tmp_path / "kvgroups" / "cubin"


def test_bad_arch_is_a_typed_error():
    with pytest.raises(KernelCompileError, match="sm_XY"):
        nvrtc.cache_key("ampere")


def test_compile_errors_are_typed(monkeypatch):
    monkeypatch.setattr(nvrtc, "kernel_source", lambda: "this is not C++")
    with pytest.raises(KernelCompileError, match="NVRTC failed"):
        nvrtc.compile_cubin("sm_90")


def test_every_entry_point_waits_for_the_kernel_before_it():
    # The launcher starts these kernels with programmatic stream serialization (driver.py):
    # that is only safe for a kernel that waits for the grid before it ahead of any access
    # but an L2 prefetch. The warp store asks L2 for its first source segment, then waits;
    # both warp kernels then let the next launch start; nothing else comes before the wait.
    src = nvrtc.kernel_source()
    bodies = re.findall(r"__global__[^{]*\{[\s\\]*([^\s\\]+)", src)
    assert len(bodies) == src.count("__global__") >= 3  # the classic macro, two warp kernels
    assert set(bodies) == {"kvg_wait_for_prior_grid();", "kvg_warp_prefetch_store_source(p);"}
    assert src.count("kvg_warp_prefetch_store_source(p);") == 1
    helper = src[src.index("void kvg_wait_for_prior_grid()") :]
    helper = helper[: helper.index("\n}\n")]
    assert "__CUDA_ARCH__ >= 900" in helper and 'asm volatile("griddepcontrol.wait;"' in helper
    assert "launch_dependents" not in helper
    triggered = re.findall(
        r"(kvg_\w+)\(const __grid_constant__ KvgParams p\) \{\s*"
        r"(?:kvg_warp_prefetch_store_source\(p\);\s*)?"
        r"kvg_wait_for_prior_grid\(\);\s*kvg_let_next_grid_start\(\);",
        src,
    )
    assert sorted(triggered) == ["kvg_load_v16_warp", "kvg_store_v16_warp"]
    prefetched = re.findall(
        r"(kvg_\w+)\(const __grid_constant__ KvgParams p\) \{\s*"
        r"kvg_warp_prefetch_store_source\(p\);",
        src,
    )
    assert prefetched == ["kvg_store_v16_warp"]
    assert src.count("kvg_let_next_grid_start();") == 2


def test_the_prefetch_before_the_wait_only_reads_through_l2_and_prefetches():
    # Before griddepcontrol.wait the kernel before may still be writing ids and pages: the
    # prefetch may read them only past L1 (ld.global.cg) and may not write anything.
    src = nvrtc.kernel_source()
    parts = []
    for name in ("kvg_load_id_l2", "kvg_warp_prefetch_store_source"):
        body = src[src.index(f"{name}(const KvgParams& p") :]
        parts.append(body[: body.index("\n}\n")])
    helpers = "\n".join(parts)
    instructions = re.findall(r'asm(?: volatile)?\("([A-Za-z.:0-9]+)', helpers)
    assert instructions and set(instructions) <= {
        "ld.global.cg.s32",
        "ld.global.cg.s64",
        "ld.global.cg.u64",
        "mov.u32",
        "cp.async.bulk.prefetch.L2.global",
    }
    assert "kvg_load_id(" not in helpers and "kvg_object(" not in helpers
    assert "kvg_report" not in helpers and "kvg_st" not in helpers
    assert re.search(r"if \(id < 0 \|\| id >= p\.num_blocks\) return;", helpers)
