import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import sys

    import kvgroups_core
    from kvgroups_core import (
        EngineGroupInfo, EngineKVFormat, KVLayerGroupsManager, TensorSpec,
        manager_from_shape_spec,
    )
    from kvgroups_tools.cli_plan import plan_summary

    caches = [TensorSpec((2, 64, 16, 8, 128), "bfloat16")] * 6
    infos = [EngineGroupInfo(engine_group_id=1, layer_indices=(0, 1, 2, 3, 4),
                             sw_size_tokens=1024),
             EngineGroupInfo(engine_group_id=0, layer_indices=(5,))]
    manager = KVLayerGroupsManager(caches, EngineKVFormat.NL_X_TWO_NB_BS_NH_HS, infos)
    assert manager.num_object_groups == 2
    plan_summary(manager_from_shape_spec("(2,1024,16,8,128):bfloat16:32"))
    from kvgroups_core.planner import build_plan

    plan, _ = build_plan(manager, caches, {0: list(range(16)), 1: list(range(16, 32))}, "store")
    assert plan.num_chunks == 1
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "jax", "jaxlib"))
    print(",".join(leaked))
""")


def test_core_import_manager_and_planning_leave_frameworks_unimported():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


def test_ruff_bans_framework_imports_in_the_core():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed")
    result = subprocess.run([ruff, "check", "--select", "TID251", "kvgroups_core"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_ruff_ban_would_catch_a_framework_import(tmp_path):
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed")
    bad = ROOT / "kvgroups_core" / "_ban_probe_tmp.py"
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\nfrom jax import numpy\n")
    result = subprocess.run(
        [ruff, "check", "--select", "TID251", "--config", str(ROOT / "pyproject.toml"),
         "--stdin-filename", str(bad), "-"],
        input=probe.read_text(), capture_output=True, text=True, cwd=ROOT,
    )
    assert result.returncode != 0
    assert "TID251" in result.stdout
