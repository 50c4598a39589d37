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
    rc = run_demo(store_backend="numpy", load_backend="numpy", layers=4, num_chunks=3,
                  corrupt=True, out=out)
    assert rc == 1
    assert "FAILED" in out.getvalue()


def test_demo_cli_progress_bar_for_many_batches(capsys):
    rc = main(["demo", "--store-backend", "numpy", "--load-backend", "numpy", "--layers", "2",
               "--chunks", "4", "--batch-chunks", "1", "--model", "gpt-oss-20b"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "4/4 chunks" in out


def test_demo_rejects_a_request_larger_than_the_cache():
    with pytest.raises(ValueError, match="num_chunks"):
        run_demo(store_backend="numpy", load_backend="numpy", layers=2, num_chunks=8,
                 num_blocks=64, out=io.StringIO())


def test_demo_runs_a_shape_spec():
    out = io.StringIO()
    rc = run_demo(spec="(2,128,16,2,64):float16:3;(1,128,16,1,576):bfloat16:2",
                  store_backend="numpy", load_backend="numpy", num_chunks=2, out=out)
    assert rc == 0, out.getvalue()
