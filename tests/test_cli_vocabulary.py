"""The command lines' shared vocabulary (moonvit.cli) and the atomic file writes (moonvit.files)."""

import argparse

import pytest
import torch

from moonvit.cli import add_dtype_argument, dtype_name, fraction, output_dir, positive_int, torch_dtype
from moonvit.files import atomic_path, write_text_atomic


@pytest.mark.parametrize(
    "spelling, name",
    [
        ("bf16", "bf16"),
        ("bfloat16", "bf16"),
        ("BF16", "bf16"),
        ("float32", "fp32"),
        ("fp16", "fp16"),
        ("half", "fp16"),
        ("double", "fp64"),
    ],
)
def test_every_dtype_spelling_maps_to_one_short_name(spelling, name):
    assert dtype_name(spelling) == name
    assert (
        torch_dtype(spelling)
        == {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}[name]
    )


def test_the_dtype_flag_prints_the_short_name_and_refuses_others(capsys):
    parser = argparse.ArgumentParser()
    add_dtype_argument(parser, "bf16", "compute dtype")
    assert parser.parse_args(["--dtype", "bfloat16"]).dtype == "bf16"
    assert parser.parse_args([]).dtype == "bf16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "fp64"])
    assert "choose from bf16, fp16, fp32" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "int8"])
    assert "unknown dtype 'int8'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "parse, text", [(positive_int, "0"), (positive_int, "x"), (fraction, "1"), (fraction, "0"), (fraction, "nan?")]
)
def test_number_types_refuse_out_of_range_values(parse, text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse(text)


def test_output_dir_refuses_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(argparse.ArgumentTypeError, match="is not a folder"):
        output_dir(str(tmp_path / "file"))
    assert output_dir(str(tmp_path / "new")) == tmp_path / "new"


def test_atomic_writes_leave_the_old_file_on_failure(tmp_path):
    target = tmp_path / "a.txt"
    write_text_atomic(target, "old")
    with pytest.raises(RuntimeError), atomic_path(target) as temporary:
        temporary.write_text("half")
        raise RuntimeError("killed")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]
    write_text_atomic(target, "new")
    assert target.read_text() == "new"
