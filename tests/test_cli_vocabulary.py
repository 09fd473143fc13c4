"""The command lines' shared vocabulary (moonvit.cli) and the atomic file writes (moonvit.files)."""

import argparse
import functools
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moonvit.__main__ as moonvit_main
import moonvit_eval.feature_maps as feature_maps
import moonvit_eval.linear_probe as linear_probe
import moonvit_projector.export as export
import moonvit_train.config as train_config
from moonvit import CheckpointError, cli
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


# ---- every command line ---------------------------------------------------------------------

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
BENCHMARK_SCRIPTS = (
    "bench_cpu",
    "bench_compile",
    "bench_export",
    "bench_probe",
    "bench_processor",
    "bench_vit",
    "cuda_check",
    "gemm_rates",
    "vit_claims",
)


def benchmark_parser(name: str) -> argparse.ArgumentParser:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name).build_parser()
    finally:
        sys.path.remove(str(BENCHMARKS))


PARSERS = {
    "python -m moonvit": moonvit_main.build_parser,
    "moonvit_projector.export": export.build_parser,
    "moonvit_eval.linear_probe": linear_probe.build_parser,
    "moonvit_eval.feature_maps": feature_maps.build_parser,
    "python -m moonvit_train": train_config.build_parser,
    **{name: functools.partial(benchmark_parser, name) for name in BENCHMARK_SCRIPTS},
}
CHECKED_NUMBERS = {
    cli.positive_int: ["0", "-3", "2.5", "x"],
    cli.non_negative_int: ["-1", "1e3", "x"],
    cli.patch_budget: ["3", "0", "-4"],
    cli.positive_float: ["0", "-1e-3", "nan", "inf", "x"],
    cli.non_negative_float: ["-0.5", "nan", "x"],
    cli.fraction: ["0", "1", "1.5", "nan"],
    cli.probability: ["-0.1", "1.5", "nan", "inf"],
    cli.drop_rate: ["1", "-0.1", "nan", "x"],
}


def actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("name", PARSERS)
def test_every_flag_has_help_and_no_number_goes_unchecked(name):
    for action in actions(PARSERS[name]()):
        assert action.help and action.help.strip(), f"{name} {action.option_strings} has no help"
        assert action.type not in (int, float), f"{name} {action.option_strings} takes an unchecked number"


@pytest.mark.parametrize("name", PARSERS)
def test_bad_numbers_end_in_one_usage_error_at_parse_time(name, capsys):
    checked = [
        (a, bad) for a in actions(PARSERS[name]()) if a.type in CHECKED_NUMBERS for bad in CHECKED_NUMBERS[a.type]
    ]
    assert checked or name in ("cuda_check",), f"{name} has no checked number flags"
    for action, bad in checked:
        with pytest.raises(SystemExit) as exit_info:
            flag = action.option_strings[0]
            multiple = isinstance(action.nargs, int) and action.nargs > 1  # --randaugment OPS MAGNITUDE
            PARSERS[name]().parse_args([flag, *[bad] * action.nargs] if multiple else [f"{flag}={bad}"])
        assert exit_info.value.code == 2
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"argument {action.option_strings[0]}" in error and bad in error, error


def test_the_shared_flags_mean_the_same_everywhere(tmp_path):
    """dtype spellings, device, budget, threads and seed: the same type, default and spelling."""
    seen = 0
    for name, build in PARSERS.items():
        by_flag = {a.option_strings[0]: a for a in actions(build()) if a.option_strings}
        if "--threads" in by_flag:
            assert by_flag["--threads"].type is cli.positive_int and by_flag["--threads"].default is None, name
            seen += 1
        if "--max-patches-per-pack" in by_flag:
            assert by_flag["--max-patches-per-pack"].type is cli.patch_budget, name
        if "--seed" in by_flag:
            assert by_flag["--seed"].type is cli.non_negative_int and by_flag["--seed"].default == 0, name
        if "--device" in by_flag:
            # the export's --engine ray names its actors' device, which its driver need not reach:
            # spelled at parse time, reached after it on the local engine (the test below)
            expected = cli.device_spelling if name == "moonvit_projector.export" else cli.device_name
            assert by_flag["--device"].type is expected, name
        if "--checkpoint" in by_flag:
            assert by_flag["--checkpoint"].type is cli.checkpoint_source, name
        if "--dtype" in by_flag:
            assert by_flag["--dtype"].type("bfloat16") == "bf16", name
    assert seen == len(PARSERS) - 1  # all but the GPU check take --threads


def test_cuda_without_cuda_is_refused_at_parse_time(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with_device = [
        name for name, build in PARSERS.items() if any("--device" in a.option_strings for a in actions(build()))
    ]
    assert with_device == [
        "python -m moonvit",
        "moonvit_projector.export",
        "moonvit_eval.linear_probe",
        "python -m moonvit_train",
        "cuda_check",
    ]
    for name in with_device:
        for device in ("cuda", "cuda:1"):
            with pytest.raises(SystemExit) as exit_info:
                if name == "moonvit_projector.export":  # checked once the engine is known
                    export.main(["--inputs", ".", "--checkpoint", "owner/name", "--out", "out", "--device", device])
                else:
                    PARSERS[name]().parse_args(["--device", device])
            assert exit_info.value.code == 2
            assert "no usable CUDA device" in capsys.readouterr().err, name
    with pytest.raises(SystemExit) as exit_info:
        export.main(["--inputs", ".", "--checkpoint", "owner/name", "--out", "out", "--device", "gpu"])
    assert exit_info.value.code == 2 and "unsupported device 'gpu'" in capsys.readouterr().err


@pytest.mark.parametrize("name", PARSERS)
def test_an_output_path_that_is_a_file_is_refused_at_parse_time(name, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    outputs = [a for a in actions(PARSERS[name]()) if a.type in (cli.output_dir, cli.output_file)]
    for action in outputs:
        for bad in (tmp_path / "file" / "below", tmp_path) if action.type is cli.output_file else (tmp_path / "file",):
            with pytest.raises(SystemExit):
                PARSERS[name]().parse_args([action.option_strings[0], str(bad)])
            assert "folder" in capsys.readouterr().err


def test_library_loaders_refuse_cuda_without_cuda(tmp_path, monkeypatch):
    from helpers import make_checkpoint

    from moonvit import MoonViT
    from moonvit_projector import MoonViTProjector

    folder = make_checkpoint(tmp_path / "ckpt")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for load in (MoonViT.from_pretrained, MoonViTProjector.from_pretrained):
        with pytest.raises(ValueError, match="no usable CUDA device"):
            load(folder, device="cuda")
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        MoonViT.from_pretrained(folder, device="gpu")


# ---- types -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "parse, good, value",
    [
        (cli.positive_int, "3", 3),
        (cli.non_negative_int, "0", 0),
        (cli.patch_budget, "4", 4),
        (cli.positive_float, "1e-4", 1e-4),
        (cli.non_negative_float, "0", 0.0),
        (cli.fraction, "0.25", 0.25),
        (cli.probability, "1", 1.0),
        (cli.drop_rate, "0", 0.0),
    ],
)
def test_checked_numbers_accept_their_range(parse, good, value):
    assert parse(good) == value
    for bad in CHECKED_NUMBERS[parse]:
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)


def test_paths_are_checked_for_what_they_must_be(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(argparse.ArgumentTypeError, match="is a file, not a folder"):
        cli.output_dir(str(tmp_path / "file" / "sub" / "deeper"))
    with pytest.raises(argparse.ArgumentTypeError, match="is a folder, not a file"):
        cli.existing_file(str(tmp_path))
    with pytest.raises(argparse.ArgumentTypeError, match="does not exist"):
        cli.existing_path(str(tmp_path / "missing"))
    with pytest.raises(argparse.ArgumentTypeError, match="is a file, not a folder"):
        cli.existing_folder(str(tmp_path / "file"))
    assert cli.output_file(str(tmp_path / "new" / "out.md")) == tmp_path / "new" / "out.md"


def test_checkpoint_sources_are_folders_or_hub_ids(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert cli.checkpoint_source(str(tmp_path)) == str(tmp_path)
    assert cli.checkpoint_source("moonshotai/Kimi-VL-A3B-Instruct") == "moonshotai/Kimi-VL-A3B-Instruct"
    with pytest.raises(argparse.ArgumentTypeError, match="is a file, not a folder: pass the checkpoint folder"):
        cli.checkpoint_source(str(tmp_path / "model.safetensors"))
    for missing in (str(tmp_path / "nope"), "nope", "a/b/c", "./x/y"):
        with pytest.raises(argparse.ArgumentTypeError, match="does not exist"):
            cli.checkpoint_source(missing)


def test_warnings_print_as_one_line_without_source():
    script = (
        "import warnings\n"
        "from moonvit import cli\n"
        "with cli.one_line_warnings():\n"
        "    warnings.warn('selected lr=1 is at the edge')\n"
        "warnings.warn('after')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    lines = result.stderr.splitlines()
    assert lines[0] == "warning: selected lr=1 is at the edge"
    assert "UserWarning: after" in lines[1]  # the format is restored afterwards


def test_user_errors_end_in_one_line_and_status_1(capsys):
    parser = argparse.ArgumentParser(prog="prog")
    with pytest.raises(SystemExit) as exit_info, cli.exit_on(parser, KeyError):
        raise CheckpointError("checkpoint folder x does not exist")
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == "prog: error: checkpoint folder x does not exist\n"
    with pytest.raises(ZeroDivisionError), cli.exit_on(parser):  # bugs still show their traceback
        raise ZeroDivisionError


# ---- --attn through every command -----------------------------------------------------------

ENCODER_COMMANDS = (
    "python -m moonvit",
    "moonvit_projector.export",
    "moonvit_eval.linear_probe",
    "python -m moonvit_train",
)


class Reached(Exception):
    """Raised where a command is about to run its encoder, carrying it."""

    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder


def test_every_command_that_runs_an_encoder_takes_one_attn_flag():
    def attn(name):
        return next(a for a in actions(PARSERS[name]()) if "--attn" in a.option_strings)

    shared = attn("python -m moonvit")
    assert shared.type is cli.attention_backend and shared.default == "auto"
    for name in ENCODER_COMMANDS:
        flag = attn(name)
        assert (flag.type, flag.default, flag.metavar, flag.help) == (
            shared.type,
            shared.default,
            shared.metavar,
            shared.help,
        ), name


@pytest.mark.parametrize("name", ENCODER_COMMANDS)
def test_an_unknown_attn_backend_is_one_usage_line(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        PARSERS[name]().parse_args(["--attn", "flash"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.endswith(
        "error: argument --attn: unknown attention backend 'flash'; choose from " + ", ".join(cli.attention_names())
    )


def test_attn_reaches_the_main_jobs_encoder(tmp_path, monkeypatch):
    def encode(encoder, *args, **kwargs):
        raise Reached(encoder)

    monkeypatch.setattr(moonvit_main, "iter_encode_images", encode)
    with pytest.raises(Reached) as reached:
        moonvit_main.main(["--preset", "tiny", "--dtype", "fp32", "--attn", "eager", "--out", str(tmp_path)])
    assert reached.value.encoder.config.attn_implementation == "eager"


def test_attn_reaches_the_exports_encoder_and_run(tmp_path):
    from helpers import make_checkpoint

    folder = make_checkpoint(tmp_path / "ckpt")
    args = ["--inputs", str(tmp_path), "--checkpoint", str(folder), "--out", str(tmp_path / "out")]
    run = export.export_run(export.build_parser().parse_args([*args, "--attn", "eager", "--device", "cpu"]))
    assert run.attn == "eager"
    assert export.export_run(export.build_parser().parse_args(args)).attn == "auto"
    models = export.load_models(run.checkpoint, run.kinds, torch.float32, torch.device("cpu"), attn=run.attn)
    assert models.encoder.config.attn_implementation == "eager"
    assert models.attention(torch.device("cpu")) == "eager"  # what run.json's compute.attention records


def test_attn_reaches_the_probes_encoder(tmp_path, monkeypatch):
    def probe_view(view, probe, dataset, encoder, cache):
        raise Reached(encoder.model)

    monkeypatch.setattr(linear_probe, "probe_view", probe_view)
    args = ["--preset", "tiny", "--random-init", "--dataset", "digits", "--no-logreg", "--no-baseline"]
    with pytest.raises(Reached) as reached:
        linear_probe.main([*args, "--device", "cpu", "--attn", "eager", "--out", str(tmp_path / "out")])
    assert reached.value.encoder.config.attn_implementation == "eager"


def test_attn_reaches_the_trainers_encoder_and_does_not_define_the_run(tmp_path, monkeypatch):
    import moonvit_train.loop as train_loop
    from moonvit_train.config import parse_args, run_defining

    class Trainer(train_loop.Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            raise Reached(self.encoder)

    args = ["--objective", "supervised", "--preset", "tiny", "--dataset", "digits", "--steps", "1", "--threads", "1"]
    args += ["--device", "cpu", "--no-progress", "--out", str(tmp_path)]
    config = parse_args([*args, "--attn", "eager"])
    assert config.runtime.attn == "eager" and config.flat()["attn"] == "eager"
    assert run_defining(config) == run_defining(parse_args(args))  # a run resumes on another backend
    monkeypatch.setattr(train_loop, "Trainer", Trainer)
    previous = torch.get_num_threads()
    try:
        with pytest.raises(Reached) as reached:
            train_loop.main([*args, "--attn", "eager"])
    finally:
        torch.set_num_threads(previous)
    assert reached.value.encoder.config.attn_implementation == "eager"


def test_a_backend_that_cannot_run_is_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    """flash-attn installed but asked for on the CPU: the export and the probe end in one error line
    (status 1), the trainer in one usage line (status 2), as does flex, which has no backward on CPU."""
    from helpers import make_checkpoint

    from moonvit.model import attention, flex

    monkeypatch.setattr(attention, "_FLASH_ATTN_INSTALLED", True)
    monkeypatch.setattr(flex, "_toolchain", lambda device_type: True)  # flex could run, forward only
    cannot = "error: attn_implementation='flash_attention_2' cannot run: flash-attn needs a CUDA device"
    folder = make_checkpoint(tmp_path / "ckpt")
    flash = ["--attn", "flash_attention_2", "--device", "cpu"]
    inputs = ["--inputs", str(tmp_path), "--checkpoint", str(folder), "--out", str(tmp_path / "e")]
    probe = ["--preset", "tiny", "--random-init", "--dataset", "digits", "--no-logreg", "--out", str(tmp_path / "p")]
    train = ["--objective", "supervised", "--preset", "tiny", "--dataset", "digits", "--steps", "1"]
    train += ["--device", "cpu", "--out", str(tmp_path / "t")]
    for command, args, status, line in (
        (export.main, [*inputs, *flash], 1, cannot),
        (linear_probe.main, [*probe, *flash], 1, cannot),
        (train_config.parse_args, [*train, *flash], 2, "argument --attn: " + cannot.removeprefix("error: ")),
        (train_config.parse_args, [*train, "--attn", "flex"], 2, "flex attention has no backward on CPU"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            command(args)
        assert exit_info.value.code == status, args
        err = capsys.readouterr().err
        assert "Traceback" not in err and line in err.strip().splitlines()[-1], err
    assert not any((tmp_path / name).exists() for name in ("e", "p", "t"))


def test_shared_options_are_added_by_name_and_read_back_by_field():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Run:
        attn: str
        threads: int | None = None
        seed: int = 0
        extra: str = "kept"

    parser = argparse.ArgumentParser()
    cli.add_shared_arguments(parser, *cli.ENCODER_OPTIONS, "seed", seed={"help": "seed of the test"})
    args = parser.parse_args(["--attn", "eager", "--threads", "2", "--device", "cpu"])
    assert cli.typed_run(Run, args) == Run("eager", 2, 0)
    assert cli.typed_run(Run, args, seed=5, extra="derived") == Run("eager", 2, 5, "derived")
    with pytest.raises(TypeError, match="Run has no field nope"):
        cli.typed_run(Run, args, nope=1)
    with pytest.raises(ValueError, match="no shared option 'colour'"):
        cli.add_shared_arguments(argparse.ArgumentParser(), "colour")
    with pytest.raises(ValueError, match="settings of options not added: dtype"):
        cli.add_shared_arguments(argparse.ArgumentParser(), "seed", dtype={"default": "bf16", "help": "x"})
