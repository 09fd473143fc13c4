"""One vocabulary for the package's command lines (``python -m moonvit``, ``moonvit_projector.export``,
``moonvit_eval.linear_probe``, the trainer and the benchmarks).

Every program takes the same flags for the same things, with the same spellings,
checks and defaults: ``--dtype`` (``bf16`` / ``fp16`` / ``fp32`` / ``fp64``, the
long names ``bfloat16``, ``float32``, ... accepted and printed short),
(llama.cpp's ``f32`` / ``f16`` too), ``--device`` (``cpu``, ``cuda``, ``cuda:N``, refused at parse time where torch
has no CUDA), ``--threads``, ``--max-patches-per-pack``, ``--checkpoint`` (a
folder or a hub id), ``--seed``, ``--side-limit-mode``, ``--attn`` and ``--opset``. Every number and path
has a checking type here: argument types raise ``argparse.ArgumentTypeError``, so
a bad value ends in one usage line and exit status 2 before any work starts (each command's
parser is an :class:`ArgumentParser`: its usage errors are one line, without the usage block).

What can only fail later (a corrupt checkpoint, an unreadable image, a full disk) ends in one
``error:`` line and exit status 1 through :func:`exit_on`, Ctrl-C in one ``interrupted:`` line
saying what was kept and exit status 130, and warnings print as
one ``warning:`` line each (:func:`one_line_warnings`), not with a source line.

A command takes these by name (:func:`add_shared_arguments`, the names of :data:`SHARED_OPTIONS`;
:data:`ENCODER_OPTIONS` for every command that runs an encoder) and reads them back into its typed
run by field name (:func:`typed_run`), so a new shared option is added in this module, once.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import torch

from .devices import check_device
from .files import disk_full_error, folder_problem
from .media.image import ImageLoadError, decompression_bombs_raised
from .media.packing import DEFAULT_MAX_PATCHES_PER_PACK
from .media.processor import ImageSizeError
from .media.video import VideoNotSupportedError
from .model.attention import AttentionUnavailableError, attention_names, check_attn_implementation
from .onnx.export import DEFAULT_OPSET, MAX_OPSET, MIN_OPSET
from .weights.checkpoint import SAVE_LAYOUTS
from .weights.hub import is_hub_id
from .weights.storage import CheckpointError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "DTYPES",
    "ArgumentParser",
    "ENCODER_OPTIONS",
    "MIN_PATCH_BUDGET",
    "NOTICE_LOGGERS",
    "SHARED_OPTIONS",
    "add_attn_argument",
    "add_budget_argument",
    "add_checkpoint_argument",
    "add_device_argument",
    "add_dtype_argument",
    "add_opset_argument",
    "add_projector_from_argument",
    "add_save_layout_argument",
    "add_seed_argument",
    "add_shared_arguments",
    "add_image_rule_argument",
    "add_side_limit_argument",
    "add_threads_argument",
    "add_workers_argument",
    "apply_threads",
    "attention_backend",
    "checkpoint_source",
    "device_name",
    "drop_rate",
    "dtype_name",
    "escaped_output",
    "exit_on",
    "existing_file",
    "existing_folder",
    "existing_path",
    "fraction",
    "non_negative_float",
    "non_negative_int",
    "one_line_warnings",
    "opset_version",
    "output_dir",
    "output_file",
    "patch_budget",
    "positive_float",
    "positive_int",
    "probability",
    "torch_dtype",
    "typed_run",
]

MIN_PATCH_BUDGET = 4
"""The smallest ``--max-patches-per-pack``: one 2x2 merged token (the smallest padded image)."""

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp64": torch.float64,
}
_DTYPE_ALIASES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "f16": "fp16",
    "f32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "float64": "fp64",
    "double": "fp64",
}


def dtype_name(text: str) -> str:
    """The canonical short name (``bf16``, ``fp16``, ``fp32``, ``fp64``) of a dtype spelling."""
    name = _DTYPE_ALIASES.get(text.strip().lower(), text.strip().lower())
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {text!r}; choose from {', '.join(DTYPES)} (or bfloat16, float16, float32, float64)"
        )
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of any accepted spelling."""
    return DTYPES[dtype_name(name)]


# ---- the parser ----------------------------------------------------------------------------------

_MISSING_ARGUMENTS = ("the following arguments are required", "one of the arguments")
"""How argparse's messages for missing required arguments begin."""


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one line, ``prog: error: message``, with exit
    status 2: no usage block before it (the trainer's is over 30 lines). A missing required argument
    adds where the options are listed (``see prog --help``)."""

    def error(self, message: str) -> NoReturn:
        if message.startswith(_MISSING_ARGUMENTS):
            message += f"; see {self.prog} --help"
        self.exit(2, f"{self.prog}: error: {message}\n")


# ---- numbers -----------------------------------------------------------------------------------


def _number(text: str, parse: Callable[[str], Any], accept: Callable[[Any], bool], what: str) -> Any:
    try:
        value = parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not accept(value):  # NaN fails every comparison, so it is refused too
        raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
    return value


def positive_int(text: str) -> int:
    """An integer of at least 1."""
    return _number(text, int, lambda v: v >= 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """An integer of at least 0."""
    return _number(text, int, lambda v: v >= 0, "an integer >= 0")


def patch_budget(text: str) -> int:
    """A patch budget: an integer of at least :data:`MIN_PATCH_BUDGET` (one merged token)."""
    return _number(
        text, int, lambda v: v >= MIN_PATCH_BUDGET, f"a patch budget of at least {MIN_PATCH_BUDGET} (one 2x2 token)"
    )


def opset_version(text: str) -> int:
    """An ONNX opset the exporter writes: :data:`~moonvit.onnx.MIN_OPSET` to :data:`~moonvit.onnx.MAX_OPSET`."""
    return _number(text, int, lambda v: MIN_OPSET <= v <= MAX_OPSET, f"an ONNX opset from {MIN_OPSET} to {MAX_OPSET}")


def positive_float(text: str) -> float:
    """A finite number above 0."""
    return _number(text, float, lambda v: 0 < v < float("inf"), "a positive number")


def non_negative_float(text: str) -> float:
    """A finite number of at least 0."""
    return _number(text, float, lambda v: 0 <= v < float("inf"), "a number >= 0")


def fraction(text: str) -> float:
    """A number strictly between 0 and 1."""
    return _number(text, float, lambda v: 0.0 < v < 1.0, "a fraction in (0, 1)")


def probability(text: str) -> float:
    """A number from 0 to 1, both included."""
    return _number(text, float, lambda v: 0.0 <= v <= 1.0, "a probability in [0, 1]")


def drop_rate(text: str) -> float:
    """A rate from 0 (included) to 1 (excluded): a share that may be dropped, never all of it."""
    return _number(text, float, lambda v: 0.0 <= v < 1.0, "a rate in [0, 1)")


# ---- devices and paths -------------------------------------------------------------------------


def device_name(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``, refused when torch cannot reach that device here."""
    try:
        device = check_device(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"unsupported device {text!r}; expected cpu, cuda or cuda:N")
    return text


def output_dir(text: str) -> Path:
    """A folder to write into: an existing folder, or a new one whose nearest existing parent is a
    writable folder (not a file)."""
    path = Path(text)
    if path.exists():
        if not path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} exists and is not a folder")
        return path
    _check_creatable(text, path)
    return path


def output_file(text: str) -> Path:
    """A file to write: not an existing folder, in a folder that exists or can be created."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    _check_creatable(text, path)
    return path


def _check_creatable(text: str, path: Path) -> None:
    """Refuse a path whose nearest existing ancestor is a file or not writable."""
    parent = next(p for p in path.absolute().parents if p.exists())
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot create {text}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot create {text}: {parent} is not writable")


def existing_path(text: str) -> Path:
    """A file or folder that exists."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text} does not exist")
    return path


def existing_file(text: str) -> Path:
    """A file that exists (not a folder)."""
    path = existing_path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    return path


def existing_folder(text: str) -> Path:
    """A folder that exists (not a file)."""
    problem = folder_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text} {problem}")
    return Path(text)


def checkpoint_source(text: str) -> str:
    """A checkpoint folder, or a hub id (``owner/name``) that is not a local path."""
    problem = folder_problem(text)
    if problem is None or (problem == "does not exist" and is_hub_id(text)):
        return text
    if problem == "does not exist":
        raise argparse.ArgumentTypeError(f"{text} does not exist (and is not a hub id, owner/name)")
    raise argparse.ArgumentTypeError(f"{text} {problem}: pass the checkpoint folder that holds it")


def add_dtype_argument(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    default: str | None,
    help: str,
    choices: tuple[str, ...] = ("bf16", "fp16", "fp32"),
    flag: str = "--dtype",
) -> None:
    """``--dtype``: any accepted spelling in, the short name out (checked against ``choices``)."""

    def parse(text: str) -> str:
        name = dtype_name(text)
        if name not in choices:
            raise argparse.ArgumentTypeError(f"{flag} {text}: choose from {', '.join(choices)}")
        return name

    parse.__name__ = "dtype"
    shown = f" (default: {default})" if default is not None else ""
    parser.add_argument(flag, type=parse, default=default, metavar="{" + ",".join(choices) + "}", help=help + shown)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_spelling(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` as a spelling only, whether or not this process reaches it
    (a device that other processes use, e.g. a cluster's workers)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"unsupported device {text!r}; expected cpu, cuda or cuda:N")
    return text


def add_device_argument(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, help: str = "cpu, cuda or cuda:N", *, here: bool = True
) -> None:
    """``--device``, defaulting to cuda where there is one; checked as reachable from this process
    (:func:`device_name`), or with ``here=False`` as a spelling only (:func:`device_spelling`)."""
    parser.add_argument(
        "--device",
        type=device_name if here else device_spelling,
        default=default_device(),
        help=f"{help} (default: {default_device()})",
    )


def attention_backend(text: str) -> str:
    """``auto`` or a registered attention backend whose package is installed."""
    try:
        check_attn_implementation(text)
    except ValueError:
        choices = ", ".join(attention_names())
        raise argparse.ArgumentTypeError(f"unknown attention backend {text!r}; choose from {choices}") from None
    except AttentionUnavailableError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def add_attn_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--attn``: the attention backend, checked at parse time (unknown, or its package missing); whether
    it can run on the chosen device and dtype is checked before any work."""
    parser.add_argument(
        "--attn",
        type=attention_backend,
        default="auto",
        metavar="{" + ",".join(attention_names()) + "}",
        help="attention backend (default: auto)",
    )


def add_threads_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--threads``: torch's CPU threads for this process (default: torch's own choice)."""
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help=f"torch CPU threads (default: torch's choice, {torch.get_num_threads()} here)",
    )


def add_workers_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup, what: str = "packs") -> None:
    """``--workers``: threads preparing the next units of work while this one runs (see
    :func:`moonvit.prefetch.prefetch`); the results are the same as with 0."""
    parser.add_argument(
        "--workers",
        type=non_negative_int,
        default=0,
        help=f"threads decoding the next {what} while this one runs; same results as 0 (default: 0, inline)",
    )


def apply_threads(threads: int | None) -> int:
    """Set torch's CPU thread count when given; return the count in effect."""
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def add_budget_argument(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, default: int = DEFAULT_MAX_PATCHES_PER_PACK
) -> None:
    """``--max-patches-per-pack``: the patch budget of one encoder forward."""
    parser.add_argument(
        "--max-patches-per-pack",
        type=patch_budget,
        default=default,
        help=f"patch budget of one encoder forward; larger images are scaled down to fit (default: {default})",
    )


def add_checkpoint_argument(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    help: str = "checkpoint folder (Kimi-VL release or this package's format) or hub id owner/name",
    required: bool = False,
) -> None:
    """``--checkpoint``: a local folder or a hub id, checked at parse time (a file, a missing path)."""
    parser.add_argument("--checkpoint", type=checkpoint_source, required=required, help=help)


def add_seed_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup, help: str = "random seed") -> None:
    """``--seed``: an integer >= 0 (numpy's generators refuse negative seeds), default 0."""
    parser.add_argument("--seed", type=non_negative_int, default=0, help=f"{help} (default: 0)")


def add_opset_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--opset``: the ONNX opset of an exported graph."""
    help = f"ONNX opset, {MIN_OPSET} to {MAX_OPSET} (default: {DEFAULT_OPSET})"
    parser.add_argument("--opset", type=opset_version, default=DEFAULT_OPSET, help=help)


def add_side_limit_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--side-limit-mode``: the processor's ``side_limit_mode`` (default: the checkpoint's setting)."""
    parser.add_argument(
        "--side-limit-mode",
        choices=("error", "resize"),
        default=None,
        help="an image with a side over 512 patches: refuse it (error) or scale it down (resize) "
        "(default: the checkpoint's preprocessor setting, else error)",
    )


def add_image_rule_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--image-rule``: which of a checkpoint's processor rules reads the images, by the names its family
    gives (:attr:`Family.processors <moonvit.families.Family.processors>`; see
    :func:`moonvit.media.processor_for`): a ViT tower's folder ``native`` (its family's default rule,
    :attr:`Family.default_rule <moonvit.families.Family.default_rule>`) or its checkpoint's own resize
    (``vit``, ``deit``, ``dinov2``, ``siglip``; SigLIP2's ``naflex``); an OpenVLA folder ``openvla`` (its
    default) or ``native``; MoonViT folders have one rule, their own."""
    parser.add_argument(
        "--image-rule",
        default=None,
        metavar="RULE",
        help="a ViT tower folder's processor rule, by its family's names: native (whole patches near each image's "
        "own size) or the checkpoint's own resize (vit, deit, dinov2, siglip; SigLIP2's naflex), each with the "
        "folder's normalisation (default: the family's default rule, native; SigLIP2's naflex; OpenVLA's openvla, "
        "Prismatic's resize, or native; a MoonViT folder takes its own rule)",
    )


def add_projector_from_argument(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, what: str = "projector"
) -> None:
    """``--projector-from``: a folder or hub id to read the projector from instead of ``--checkpoint``
    (a tower saved by this package, trained or fine-tuned, may hold none), checked as ``--checkpoint`` is."""
    parser.add_argument(
        "--projector-from",
        type=checkpoint_source,
        default=None,
        metavar="DIR_OR_HUB_ID",
        help=f"read the {what} from this folder or hub id instead of the checkpoint (default: the checkpoint)",
    )


def add_save_layout_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--save-layout``: the layout a saved tower is written in (:meth:`moonvit.MoonViT.save_pretrained`)."""
    parser.add_argument(
        "--save-layout",
        choices=SAVE_LAYOUTS,
        default=SAVE_LAYOUTS[0],
        help="own: this package's config.json and model.safetensors, the projector's files beside them; release: "
        "the tower's release (Kimi-VL, Kimi-K2.5 / K2.6, Kimi K3, LocateAnything-3B): its config.json and tensor "
        f"names, the projector's among them, for transformers, vLLM or SGLang (default: {SAVE_LAYOUTS[0]})",
    )


# ---- shared options, by name -------------------------------------------------------------------

SHARED_OPTIONS: dict[str, Callable[..., None]] = {
    "checkpoint": add_checkpoint_argument,
    "dtype": add_dtype_argument,
    "device": add_device_argument,
    "attn": add_attn_argument,
    "threads": add_threads_argument,
    "workers": add_workers_argument,
    "max_patches_per_pack": add_budget_argument,
    "side_limit_mode": add_side_limit_argument,
    "image_rule": add_image_rule_argument,
    "seed": add_seed_argument,
    "opset": add_opset_argument,
    "projector_from": add_projector_from_argument,
    "save_layout": add_save_layout_argument,
}
"""Each shared option by its ``dest``, the field name of the typed runs, with the function that adds it."""

ENCODER_OPTIONS = ("device", "attn", "threads")
"""How a command runs its encoder: the options of every command that runs one (``python -m moonvit``,
the export, the probe and the trainer)."""

Run = TypeVar("Run", bound="DataclassInstance")


def add_shared_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, *names: str, **settings: Mapping[str, Any]
) -> None:
    """Add the shared options ``names`` (keys of :data:`SHARED_OPTIONS`), in order; ``settings[name]``:
    the keyword arguments of that option's ``add_*_argument`` (``dtype={"default": "bf16", "help": ...}``)."""
    unknown = [name for name in names if name not in SHARED_OPTIONS]
    if unknown:
        raise ValueError(f"no shared option {unknown[0]!r}; expected one of {', '.join(SHARED_OPTIONS)}")
    unused = sorted(set(settings) - set(names))
    if unused:
        raise ValueError(f"settings of options not added: {', '.join(unused)}")
    for name in names:
        SHARED_OPTIONS[name](parser, **settings.get(name, {}))


def typed_run(cls: type[Run], args: argparse.Namespace, **values: Any) -> Run:
    """The dataclass ``cls`` of a parsed command line: each field takes ``values``' entry when given (what
    the command derives: a resolved default, another type), else the option of its name, else its default."""
    fields = [field.name for field in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {', '.join(unknown)}")
    given = {name: getattr(args, name) for name in fields if name not in values and hasattr(args, name)}
    return cls(**given, **values)


# ---- running -------------------------------------------------------------------------------------


@contextmanager
def exit_on(
    parser: argparse.ArgumentParser,
    *errors: type[Exception],
    kept: Callable[[], str] | None = None,
    writing: Path | None = None,
) -> Iterator[None]:
    """Turn the package's user-facing errors (:class:`CheckpointError`, :class:`ImageLoadError`,
    :class:`ImageSizeError`, :class:`AttentionUnavailableError`, :class:`VideoNotSupportedError` and
    ``errors``) into one ``prog: error: ...`` line on stderr and exit status 1.

    A full disk, in whatever form the writer reported it (:func:`moonvit.files.disk_full_error`), is
    one such line too, naming the path being written (``writing`` where the error names none). With
    ``kept``, Ctrl-C is one ``prog: interrupted: ...`` line, ``kept()`` saying what the command kept
    and how to go on, and exit status 130 (the shell's for a command ended by SIGINT); without it,
    Ctrl-C is not caught here."""
    caught: tuple[type[Exception], ...] = (
        CheckpointError,
        ImageLoadError,
        ImageSizeError,
        AttentionUnavailableError,
        VideoNotSupportedError,
        *errors,
    )
    try:
        yield
    except caught as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    except Exception as error:
        full = disk_full_error(error, writing)
        if full is None:
            raise
        parser.exit(1, f"{parser.prog}: error: {full}\n")
    except KeyboardInterrupt:
        if kept is None:
            raise
        parser.exit(130, f"{parser.prog}: interrupted: {kept()}\n")


@contextmanager
def escaped_output() -> Iterator[None]:
    """Within the block, what stdout and stderr cannot encode is written as a backslash escape
    (``errors="backslashreplace"``, the setting Python gives a terminal's stderr) instead of raising
    ``UnicodeEncodeError``: a printed line, a warning or a progress bar naming such a file."""
    streams = [s for s in (sys.stdout, sys.stderr) if hasattr(s, "reconfigure") and getattr(s, "errors", None)]
    previous = [stream.errors for stream in streams]  # TextIOWrappers; other streams take any str
    for stream in streams:
        stream.reconfigure(errors="backslashreplace")
    try:
        yield
    finally:
        for stream, errors in zip(streams, previous, strict=True):
            stream.reconfigure(errors=errors)


NOTICE_LOGGERS = ("moonvit.flex",)
"""Loggers whose INFO records a command line prints: what would otherwise be a silent pause (the
flex attention compile, tens of seconds)."""


@contextmanager
def one_line_warnings() -> Iterator[None]:
    """Print each warning as one ``warning: message`` line (no file, line number or source line),
    and the INFO records of :data:`NOTICE_LOGGERS` as one line each, on stderr. Pillow's
    decompression-bomb warning is raised for the whole run, in decode threads too (see
    :func:`~moonvit.media.image.decompression_bombs_raised`): the image is refused with one error.
    Text the terminal cannot encode (a file name that is not UTF-8, see :mod:`moonvit.names`) is
    printed escaped (:func:`escaped_output`), not raised."""

    def format_warning(message: Warning | str, category: type[Warning], *_: object, **__: object) -> str:
        return f"warning: {message}\n"

    previous = warnings.formatwarning
    warnings.formatwarning = format_warning
    handler = logging.StreamHandler()  # the sys.stderr of the moment the command starts
    handler.setFormatter(logging.Formatter("%(message)s"))
    loggers = [logging.getLogger(name) for name in NOTICE_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
    try:
        with decompression_bombs_raised(), escaped_output():
            yield
    finally:
        warnings.formatwarning = previous
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)
