"""``--devices`` (cli/common.py): read before anything loads; a bad value is one typed error
saying what to type; ``specmemo plan`` prints each card's layers of a split plan."""

import json

import pytest

from specmemo_core.cli.common import parse_devices
from specmemo_core.errors import SplitError
from tests.core.test_cli_errors import one_error_line, specmemo


def test_devices_are_gpu_numbers_each_once_in_order():
    assert parse_devices(None) == ()
    assert parse_devices("0,1") == (0, 1)
    assert parse_devices(" 1, 0 ") == (1, 0)
    assert parse_devices("cuda:0,cuda:2") == (0, 2)


@pytest.mark.parametrize("text, needle", [
    ("0,x", "GPU numbers separated by commas"), ("", "GPU numbers separated by commas"),
    ("0,,1", "GPU numbers separated by commas"), ("-1", "GPU numbers separated by commas"),
    ("0,0", "names a GPU twice"),
])
def test_bad_devices_are_a_typed_error_saying_what_to_type(text, needle):
    with pytest.raises(SplitError, match=needle):
        parse_devices(text)


def test_a_bad_devices_value_is_one_error_line_before_anything_loads(tmp_path):
    line = one_error_line(specmemo("generate", "--prompt", "Hello", "--devices", "0,banana", data=tmp_path))
    assert "--devices takes GPU numbers" in line and "0,banana" in line


def test_plan_prints_each_cards_layers_of_a_split(tmp_path):
    """vicuna-13b in bf16 over two 16 GiB cards that are not here: split over both."""
    args = ("plan", "--model", "shape:vicuna-13b", "--vram", "16GiB", "--device", "cuda", "--devices", "0,1",
            "--precision", "bf16", "--turns", "4")
    done = specmemo(*args, data=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    gpus = [line for line in done.stdout.splitlines() if line.startswith("gpu ")]
    assert [g.split()[1] for g in gpus] == ["cuda:0:", "cuda:1:"] and all("layers" in g for g in gpus)
    found = json.loads(specmemo(*args, "--json", data=tmp_path).stdout)
    assert [s["device"] for s in found["split"]] == ["cuda:0", "cuda:1"]
    assert sum(s["layers"] for s in found["split"]) == 40
    line = one_error_line(specmemo(*args, "--verify", data=tmp_path))  # no GPUs here
    assert "needs those GPUs here" in line


def test_bench_runs_only_our_decoders_split(tmp_path):
    line = one_error_line(specmemo("bench", "--devices", "0,1", "--methods", "hf,vanilla", data=tmp_path))
    assert "only our decoders run split" in line
    line = one_error_line(specmemo("bench", "--devices", "0;1", "--batch", "1,8", data=tmp_path))
    assert "--devices takes GPU numbers" in line
