import io

import pytest

from kvgroups_tools.cli import main
from kvgroups_tools.demo import run_demo


def test_demo_round_trip_on_numpy_verifies_every_byte():
    out = io.StringIO()
    rc = run_demo(store_backend="numpy", load_backend="numpy", layers=4, num_chunks=3, out=out)
    text = out.getvalue()
    assert rc == 0, text
    assert "kernel groups" in text and "object groups" in text
    assert "verified:" in text


def test_demo_exits_non_zero_when_an_object_byte_is_corrupted():
    out = io.StringIO()
    rc = run_demo(
        store_backend="numpy", load_backend="numpy", layers=4, num_chunks=3, corrupt=True, out=out
    )
    assert rc == 1
    assert "FAILED" in out.getvalue()


def test_demo_cli_progress_bar_for_many_batches(capsys):
    rc = main(
        [
            "demo",
            "--store-backend",
            "numpy",
            "--load-backend",
            "numpy",
            "--layers",
            "2",
            "--chunks",
            "4",
            "--batch-chunks",
            "1",
            "--model",
            "gpt-oss-20b",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "4/4 chunks" in out


def test_demo_rejects_a_request_larger_than_the_cache():
    with pytest.raises(ValueError, match="num_chunks"):
        run_demo(
            store_backend="numpy",
            load_backend="numpy",
            layers=2,
            num_chunks=8,
            num_blocks=64,
            out=io.StringIO(),
        )


def test_demo_runs_a_shape_spec():
    out = io.StringIO()
    rc = run_demo(
        spec="(2,128,16,2,64):float16:3;(1,128,16,1,576):bfloat16:2",
        store_backend="numpy",
        load_backend="numpy",
        num_chunks=2,
        out=out,
    )
    assert rc == 0, out.getvalue()


NUMPY = ["--store-backend", "numpy", "--load-backend", "numpy"]


@pytest.mark.parametrize(
    "option, value, name",
    [
        ("--chunks", "0", "argument --chunks"),
        ("--chunks", "-2", "argument --chunks"),
        ("--layers", "0", "argument --layers"),
        ("--layers", "-1", "argument --layers"),
        ("--num-blocks", "0", "argument --num-blocks"),
        ("--num-blocks", "-64", "argument --num-blocks"),
        ("--batch-chunks", "0", "argument --batch-chunks"),
        ("--batch-chunks", "-1", "argument --batch-chunks"),
        ("--seed", "-1", "argument --seed"),
        ("--device", "cuda:7", "--device"),
        ("--store-backend", "no-such-runtime", "--store-backend"),
    ],
)
def test_demo_refuses_a_bad_option_in_one_line_with_exit_2(capsys, option, value, name):
    argv = ["demo", *NUMPY, "--layers", "2", option, value]
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvgroups demo: error: {name}: "), lines
    assert "verified" not in captured.out and captured.out == ""  # refused before anything ran


def test_demo_refuses_layers_or_blocks_next_to_a_spec(capsys):
    assert main(["demo", *NUMPY, "--spec", "(2,64,16,2,64):float16:2", "--layers", "3"]) == 2
    assert capsys.readouterr().err.startswith("kvgroups demo: error: --spec: ")


@pytest.mark.parametrize(
    "backend, device", [("torch", "bogus"), ("torch", "cuda:99"), ("jax", "cpu:99")]
)
def test_demo_refuses_a_device_the_runtime_cannot_use(capsys, backend, device):
    pytest.importorskip(backend)
    pytest.importorskip(f"kvgroups_{backend}")
    argv = [
        "demo",
        "--store-backend",
        backend,
        "--load-backend",
        "numpy",
        "--layers",
        "2",
        "--device",
        device,
    ]
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvgroups demo: error: --device: "), lines
    assert repr(device) in lines[0] and captured.out == ""


def test_demo_never_says_verified_when_nothing_moved(monkeypatch):
    # Should the transfers ever produce fewer object bytes than the request holds (a batch
    # skipped, an empty result), the demo fails instead of verifying what is there.
    import kvgroups_tools.demo as demo

    real_store = demo.store
    calls = []

    def store_but_lose_the_objects(*args, **kwargs):
        objects = real_store(*args, **kwargs)
        calls.append(1)
        return objects if len(calls) == 1 else [o[:0] for o in objects]

    monkeypatch.setattr(demo, "store", store_but_lose_the_objects)
    monkeypatch.setattr(demo, "load", lambda manager, objects, caches, *a, **k: caches)
    out = io.StringIO()
    rc = run_demo(store_backend="numpy", load_backend="numpy", layers=2, num_chunks=2, out=out)
    assert rc == 1
    assert "verified" not in out.getvalue() and "FAILED" in out.getvalue()


def test_deepseek_v4_like_runs_with_the_defaults():
    out = io.StringIO()
    rc = run_demo(model="deepseek-v4-like", store_backend="numpy", load_backend="numpy", out=out)
    assert rc == 0, out.getvalue()
    assert "verified:" in out.getvalue()


def test_deepseek_v4_like_runs_from_the_command_line(capsys):
    assert main(["demo", *NUMPY, "--model", "deepseek-v4-like", "--chunks", "6"]) == 0
    assert "verified:" in capsys.readouterr().out


def test_the_first_call_is_reported_apart_from_the_bandwidth(monkeypatch):
    # A stand-in for a compile: the first load call sleeps. The load's timed figure must not
    # contain it; the first call's figure must.
    import re
    import time

    import kvgroups_tools.demo as demo

    real_load = demo.load
    calls = []

    def load_compiling_first(*args, **kwargs):
        if not calls:
            time.sleep(0.4)
        calls.append(1)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(demo, "load", load_compiling_first)
    out = io.StringIO()
    rc = run_demo(store_backend="numpy", load_backend="numpy", layers=2, num_chunks=2, out=out)
    assert rc == 0, out.getvalue()
    line = next(x for x in out.getvalue().splitlines() if x.strip().startswith("load"))
    timed, first = map(float, re.findall(r"([\d.]+) ms", line))
    assert first >= 400 > timed, line


def test_a_jax_load_reports_its_first_call():
    pytest.importorskip("jax")
    pytest.importorskip("kvgroups_jax")
    out = io.StringIO()
    rc = run_demo(store_backend="numpy", load_backend="jax", layers=2, num_chunks=2, out=out)
    assert rc == 0, out.getvalue()
    line = next(x for x in out.getvalue().splitlines() if x.strip().startswith("load"))
    assert "with jax" in line and "first call" in line and "GB/s" in line


@pytest.mark.parametrize("model", ["qwen3-next-like", "nemotron-h-like", "jamba-like"])
def test_recurrent_state_hybrids_run_from_the_command_line(model, capsys):
    assert main(["demo", *NUMPY, "--model", model, "--layers", "4", "--chunks", "2"]) == 0
    out = capsys.readouterr().out
    assert "verified:" in out and "state" in out
