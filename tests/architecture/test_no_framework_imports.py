import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Modules nobody asked for: a framework, a backend package, or the tooling.
UNWANTED = ("torch", "jax", "jaxlib", "kvgroups_torch", "kvgroups_jax", "kvgroups_tools")

LEAKED = (
    "leaked = sorted(m for m in sys.modules if m.split('.')[0] in %r)\n"
    "print(','.join(leaked))\n" % (UNWANTED,)
)

# The library alone: grouping from bare descriptors, a planned store, and a real NumPy
# store + load through the public functions.
LIBRARY_SCRIPT = (
    textwrap.dedent("""
    import sys

    import numpy as np

    import kvgroups_core
    from kvgroups_core import (
        EngineGroupInfo, EngineKVFormat, KVLayerGroupsManager, TensorSpec, load,
        manager_from_shape_spec, store,
    )
    from kvgroups_core.transfer.planner import bind, plan_call

    caches = [TensorSpec((2, 64, 16, 8, 128), "bfloat16")] * 6
    infos = [EngineGroupInfo(engine_group_id=1, layer_indices=(0, 1, 2, 3, 4),
                             sw_size_tokens=1024),
             EngineGroupInfo(engine_group_id=0, layer_indices=(5,))]
    manager = KVLayerGroupsManager(caches, EngineKVFormat.NL_X_TWO_NB_BS_NH_HS, infos)
    assert manager.num_object_groups == 2
    manager_from_shape_spec("(2,1024,16,8,128):bfloat16:32")
    plan = plan_call(bind(manager, caches), {0: list(range(16)), 1: list(range(16, 32))},
                     "store")
    assert plan.num_chunks == 1

    arrays = [np.arange(2 * 40 * 16 * 2 * 4, dtype=np.float32).reshape(2, 40, 16, 2, 4) + i
              for i in range(2)]
    fmt = [EngineKVFormat.NL_X_TWO_NB_BS_NH_HS] * 2
    numpy_manager = KVLayerGroupsManager(arrays, fmt)
    ids = np.random.default_rng(0).permutation(40)[:16]  # one chunk of 16 blocks
    objects = store(numpy_manager, arrays, ids)
    restored = [np.zeros_like(a) for a in arrays]
    load(numpy_manager, objects, restored, ids)
    for a, r in zip(arrays, restored):
        assert np.array_equal(a[:, ids], r[:, ids])
""")
    + LEAKED
)

# The plan command of the tooling needs no framework either.
TOOLING_SCRIPT = (
    textwrap.dedent("""
    import sys

    from kvgroups_core import manager_from_shape_spec
    from kvgroups_tools.cli_plan import plan_summary

    plan_summary(manager_from_shape_spec("(2,1024,16,8,128):bfloat16:32"))
""")
    + LEAKED
)


# The CUDA kernels' package, which both backends use: no framework, no backend.
CUDA_KERNELS_SCRIPT = (
    textwrap.dedent("""
    import sys

    sys.path.insert(0, "backends")
    from kvgroups_cuda import geometry, nvrtc, params

    assert nvrtc.option_words("sm_90") and params.kernel_name("store", 16, True, warp=True)
""")
    + LEAKED
)


def _leaked(script: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_core_import_manager_and_planning_load_no_framework_and_no_tooling():
    assert _leaked(LIBRARY_SCRIPT) == ""


def test_the_cuda_kernel_package_loads_no_framework():
    assert _leaked(CUDA_KERNELS_SCRIPT) == ""


def test_the_check_would_see_a_leak():
    assert _leaked("import sys\nimport kvgroups_tools.cli\n" + LEAKED) == (
        "kvgroups_tools,kvgroups_tools.cli,kvgroups_tools.cli_options"
    )


def test_the_plan_command_loads_no_framework():
    assert _leaked(TOOLING_SCRIPT) == (
        "kvgroups_tools,kvgroups_tools.cli_options,kvgroups_tools.cli_plan"
    )


def test_ruff_bans_framework_imports_in_the_core():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed")
    result = subprocess.run(
        [ruff, "check", "--select", "TID251", "kvgroups_core"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_ruff_ban_would_catch_a_framework_import(tmp_path):
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed")
    bad = ROOT / "kvgroups_core" / "_ban_probe_tmp.py"
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\nfrom jax import numpy\n")
    result = subprocess.run(
        [
            ruff,
            "check",
            "--select",
            "TID251",
            "--config",
            str(ROOT / "pyproject.toml"),
            "--stdin-filename",
            str(bad),
            "-",
        ],
        input=probe.read_text(),
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode != 0
    assert "TID251" in result.stdout


@pytest.mark.parametrize(
    "path, banned",
    [
        ("kvgroups_tools/cli_probe.py", True),
        ("kvgroups_tools/bench_probe.py", True),
        ("kvgroups_tools/bench_kits/torch_kit.py", False),
        ("kvgroups_tools/bench_kits/jax_kit.py", False),
    ],
)
def test_the_tooling_is_framework_free_except_its_kits(path, banned):
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed")
    result = subprocess.run(
        [
            ruff,
            "check",
            "--select",
            "TID251",
            "--config",
            str(ROOT / "pyproject.toml"),
            "--stdin-filename",
            str(ROOT / path),
            "-",
        ],
        input="import torch\nimport jax\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert (result.returncode != 0) == banned, result.stdout
