"""torch.distributed over gloo: groups of 4 and then 2 CPU processes (tp_gloo_worker.py).

The 4-process group loads the split of a TP=1 store (1 -> 4); the 2-process group loads the
canonical objects the 4-process group merged (4 -> 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKER = HERE / "tp_gloo_worker.py"


def execute_group(world: int, out: Path, canonical_in: Path | None = None) -> list[dict]:
    out.mkdir()
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "backends")]),
        OMP_NUM_THREADS="1",
    )
    init = out / "init"
    args = [str(init), str(out)] + ([str(canonical_in)] if canonical_in else [])
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), str(world), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} of {world} failed:\n{log}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    base = tmp_path_factory.mktemp("gloo")
    four = execute_group(4, base / "tp4")
    two = execute_group(2, base / "tp2", canonical_in=base / "tp4" / "canonical.npz")
    return {4: four, 2: two}


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_agree_on_the_fingerprint(groups, world):
    results = groups[world]
    assert len({r["fingerprint"] for r in results}) == 1
    assert all(r["own_fingerprint"] == r["fingerprint"] for r in results)
    assert [r["pair_fingerprint"] for r in results[:2]] == [results[0]["fingerprint"]] * 2


def test_fingerprints_differ_between_degrees(groups):
    assert groups[2][0]["fingerprint"] != groups[4][0]["fingerprint"]


@pytest.mark.parametrize("world", [2, 4])
def test_gathered_parts_merge_to_the_tp1_objects(groups, world):
    assert all(r["merged_is_tp1"] for r in groups[world])


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_store_into_one_shared_file_buffer_without_a_gather(groups, world):
    assert all(r["shared_is_native"] and r["shared_merges_to_tp1"] for r in groups[world])


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_load_a_split_of_another_degree_and_hold_the_right_heads(groups, world):
    assert all(r["loaded_heads_match_tp1_load"] for r in groups[world])


@pytest.mark.parametrize("world", [2, 4])
def test_a_mismatching_rank_is_named_on_every_rank(groups, world):
    for r in groups[world]:
        message = r["mismatch_error"]
        assert message is not None
        assert f"rank {world - 1} has" in message
        assert all(f"rank {q} has" not in message for q in range(world - 1))


def test_check_same_grouping_needs_an_initialised_process_group():
    from kvgroups_torch import check_same_grouping

    from kvgroups_core import EngineKVFormat as F
    from kvgroups_core import KVGroupsValueError, KVLayerGroupsManager, TensorSpec

    if dist.is_initialized():
        pytest.fail("this test process must not hold a process group")
    m = KVLayerGroupsManager([TensorSpec((2, 8, 16, 2, 32), "float16")], F.NL_X_TWO_NB_BS_NH_HS)
    with pytest.raises(KVGroupsValueError, match="init_process_group"):
        check_same_grouping(m)
