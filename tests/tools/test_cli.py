import json
import shutil
import subprocess
import sys

import pytest

from kvgroups_core import manager_from_shape_spec
from kvgroups_tools import cli
from kvgroups_tools.cli_plan import layer_ranges, object_nbytes, plan_summary, region_nbytes

SPEC = "(2,1024,16,8,128):bfloat16:30;(1,1024,64,1,576):bfloat16:2"


def run_json(capsys, *args):
    assert cli.main(["plan", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_prints_kernel_groups_object_groups_and_bytes(capsys):
    assert cli.main(["plan", "--spec", SPEC]) == 0
    out = capsys.readouterr().out
    assert f"spec: {SPEC}" in out
    assert "kernel groups" in out and "object groups" in out
    assert "0-29" in out and "30-31" in out
    assert "bfloat16" in out
    assert "31,457,280" in out  # 2 * 30 * 256 * 8 * 128 * 2
    assert "589,824" in out  # 1 * 2 * 256 * 1 * 576 * 2
    assert "bytes per chunk (all object groups): 32,047,104" in out


def test_plan_json_has_the_same_data(capsys):
    data = run_json(capsys, "--spec", SPEC)
    assert data["spec"] == SPEC
    assert data["chunk_tokens"] == 256
    assert data["num_layers"] == 32
    k0, k1 = data["kernel_groups"]
    assert (k0["layers"], k0["kv_size"], k0["nb"], k0["bs"], k0["nh"], k0["hs"], k0["dtype"]) == (
        "0-29",
        2,
        1024,
        16,
        8,
        128,
        "bfloat16",
    )
    assert k0["region_bytes"] == 2 * 30 * 256 * 8 * 128 * 2
    assert k1["region_bytes"] == 1 * 2 * 256 * 1 * 576 * 2
    (o0,) = data["object_groups"]
    assert o0["kernel_groups"] == [0, 1] and o0["sw_size_chunks"] == -1
    assert o0["object_bytes"] == k0["region_bytes"] + k1["region_bytes"]
    assert data["bytes_per_chunk"] == o0["object_bytes"]


def test_plan_region_bytes_follow_the_window_and_chunk(capsys):
    data = run_json(
        capsys,
        "--spec",
        "(2,8,16,8,128):float16:2;(2,8,16,8,128):float16:1",
        "--sw",
        "64,-1",
        "--chunk",
        "128",
    )
    k0, k1 = data["kernel_groups"]
    assert k0["slots_per_chunk"] == 64 and k1["slots_per_chunk"] == 128
    assert k0["region_bytes"] == 2 * 2 * 64 * 8 * 128 * 2
    assert [(o["kernel_groups"], o["sw_size_chunks"]) for o in data["object_groups"]] == [
        ([0], 1),
        ([1], -1),
    ]


def test_plan_single_object_group_option(capsys):
    data = run_json(
        capsys,
        "--spec",
        "(2,8,16,8,128):float16:2;(2,8,16,8,128):float16:1",
        "--sw",
        "1024,-1",
        "--single-object-group",
    )
    assert [o["kernel_groups"] for o in data["object_groups"]] == [[0, 1]]


def test_plan_tokens_per_block_option(capsys):
    data = run_json(capsys, "--spec", "(1,8,64,1,64):float16:1", "--tpb", "256")
    assert data["kernel_groups"][0]["slots_per_chunk"] == 64


def test_plan_bytes_match_the_memory_object_layout():
    m = manager_from_shape_spec(SPEC)
    summary = plan_summary(m)
    objects = pytest.importorskip("kvgroups_core.transfer.objects")
    assert summary["object_groups"][0]["object_bytes"] == objects.object_nbytes(m, 0)
    assert object_nbytes(m, 0) == region_nbytes(m, 0) + region_nbytes(m, 1)


def test_plan_rejects_a_bad_spec_with_exit_status_two(capsys):
    assert cli.main(["plan", "--spec", "(2,8,16,8,128):float64:1"]) == 2
    err = capsys.readouterr().err
    assert "Unrecognized dtype" in err
    assert "Traceback" not in err


def test_plan_rejects_an_invalid_window_with_exit_status_two(capsys):
    assert cli.main(["plan", "--spec", "(2,8,256,8,64):float16:1", "--sw", "64"]) == 2
    assert "sliding window" in capsys.readouterr().err


def test_plan_rejects_malformed_integer_lists():
    assert cli.main(["plan", "--spec", SPEC, "--sw", "a,b"]) == 2


def test_a_subcommand_is_required():
    assert cli.main([]) == 2


def test_plan_requires_a_spec():
    assert cli.main(["plan"]) == 2


def test_only_present_subcommand_modules_are_registered(monkeypatch):
    monkeypatch.setattr(cli, "SUBCOMMANDS", ("plan", "no_such_subcommand"))
    assert cli.available_subcommands() == ["plan"]
    parser = cli.build_parser()
    assert parser.parse_args(["plan", "--spec", SPEC]).command == "plan"
    with pytest.raises(SystemExit):
        parser.parse_args(["no_such_subcommand"])


def test_plan_is_always_available():
    assert "plan" in cli.available_subcommands()


@pytest.mark.parametrize(
    "layers, text",
    [
        ([0, 1, 2, 5, 7, 8], "0-2,5,7-8"),
        ([3], "3"),
        ([], ""),
        ([0, 2, 4], "0,2,4"),
    ],
)
def test_layer_ranges(layers, text):
    assert layer_ranges(layers) == text


def test_module_entry_point_runs_in_a_subprocess():
    result = subprocess.run(
        [sys.executable, "-m", "kvgroups_tools.cli", "plan", "--spec", SPEC, "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(result.stdout)["bytes_per_chunk"] == 32_047_104


def test_console_script_when_installed():
    exe = shutil.which("kvgroups")
    if exe is None:
        pytest.skip("the kvgroups console script is not installed in this environment")
    result = subprocess.run(
        [exe, "plan", "--spec", SPEC], capture_output=True, text=True, check=True
    )
    assert "kernel groups" in result.stdout
