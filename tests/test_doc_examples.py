"""Documented Python runs: every ```python block of README.md, docs/*.md and benchmarks/README.md,
and the examples in ``moonvit.ray_data``'s docstrings, executed as written.

A block runs in a scratch folder that holds what its relative names refer to (``path/to/Kimi-VL-A3B-Instruct``
and the other release folders, written at test size in each release's own layout; ``street.jpg``,
``drive.mp4``, ...), so the loaders, processors and exporters the docs show take their real paths.
What cannot exist here is swapped for a local stand-in, string for string (:func:`substitutions`):
the hub id and the object store become local folders, ``"cuda"`` becomes ``"cpu"`` on a host without
a GPU. Names that a block takes from the text around it (``pixel_values``, ``encoder``, ...) are given
by :data:`GIVEN`, each built from a small checkpoint; a block that uses any other name it neither
imports nor defines fails (a reader copying it would get a ``NameError``).

Ray blocks run on a local Ray instance. A GPU actor pool cannot run here, so every
``Dataset.map_batches`` call is first passed to Ray exactly as written, num_gpus included (Ray checks
its arguments when the call builds the plan: a GPU call without ``batch_size`` is refused there),
and then run with one CPU actor (:func:`cpu_map_batches`).
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import re
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    make_checkpoint,
    randomize_,
    tiny_k3_model,
    tiny_k3_projector,
    tiny_locateanything,
    tiny_model,
    write_k3_release_folder,
    write_k25_release_folder,
    write_kimi_vl_folder,
    write_locateanything_folder,
    write_video,
)
from PIL import Image
from test_openvla import write_openvla_folder

from moonvit import MoonViT, MoonViTImageProcessor, preset_config
from moonvit.model.linear import set_cpu_bf16_matmul
from moonvit_projector import MoonViTProjector, ProjectorConfig
from moonvit_projector.splice import MEDIA_PAD_TOKEN_ID

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
# Modules whose docstrings hold examples (reST literal blocks after a line ending in "::").
DOCSTRING_MODULES = [ROOT / "moonvit" / "ray_data.py"]

_PYTHON_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```", re.M | re.S)


# ---- the blocks ------------------------------------------------------------------------------------


@dataclass
class Block:
    """One documented example: its source, and every place it is written (identical code runs once)."""

    source: str
    places: list[str] = field(default_factory=list)

    @property
    def tree(self) -> ast.Module:
        return ast.parse(self.source)


def _markdown_blocks(path: Path) -> Iterator[tuple[str, str]]:
    text = path.read_text()
    for match in _PYTHON_FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        yield f"{path.relative_to(ROOT)}:{line}", match.group(1)


def _docstring_blocks(path: Path) -> Iterator[tuple[str, str]]:
    """The literal blocks of a module's docstrings: the lines indented under a line ending in ``::``."""
    module = ast.parse(path.read_text())
    owners = [module, *(n for n in ast.walk(module) if isinstance(n, (ast.ClassDef, ast.FunctionDef)))]
    for owner in owners:
        doc = ast.get_docstring(owner)
        if not doc:
            continue
        lines = doc.splitlines()
        for i, line in enumerate(lines):
            if not line.rstrip().endswith("::"):
                continue
            indent = len(line) - len(line.lstrip())
            body = []
            for following in lines[i + 1 :]:
                if following.strip() and len(following) - len(following.lstrip()) <= indent:
                    break
                body.append(following)
            name = getattr(owner, "name", "module")
            yield f"{path.relative_to(ROOT)}:{name}", textwrap.dedent("\n".join(body)).strip() + "\n"


def documented_blocks() -> list[Block]:
    """Every documented example, identical code (ignoring layout and comments) listed once."""
    found: dict[str, Block] = {}
    places = [p for path in DOCS if path.exists() for p in _markdown_blocks(path)]
    places += [p for path in DOCSTRING_MODULES for p in _docstring_blocks(path)]
    for place, source in places:
        try:
            key = ast.dump(ast.parse(source))
        except SyntaxError:
            key = source  # reported by the compile test, under its own place
        found.setdefault(key, Block(source)).places.append(place)
    return list(found.values())


BLOCKS = documented_blocks()


def free_names(tree: ast.Module) -> set[str]:
    """Names a block reads but never binds (by assignment, import, loop or lambda), builtins aside."""
    bound, read = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return read - bound - set(dir(builtins))


def imported_modules(tree: ast.Module) -> set[str]:
    """The top-level packages a block imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


# ---- what the blocks refer to ------------------------------------------------------------------------


class TinyLanguageModel:
    """A language model's input embeddings, all a splicing example asks of it: ids taken modulo a small
    table (a real vocabulary's ids, the placeholders' 163605 among them, reach far past it)."""

    def __init__(self, width: int, rows: int = 64) -> None:
        self.table = torch.nn.Embedding(rows, width)

    def get_input_embeddings(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda ids: self.table(ids % self.table.num_embeddings)


@dataclass
class Workspace:
    """The scratch folder the blocks run in, and the objects :data:`GIVEN` hands them."""

    root: Path
    checkpoint: Path  # a tiny checkpoint of this package's own format: tower, projector, processor
    images: list[Path]

    @property
    def images_dir(self) -> Path:
        return self.images[0].parent


def write_vit_folder(folder: Path) -> None:
    """google/vit-base-patch16-224's layout at test size: transformers' classifier folder and its processor."""
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessorPil

    torch.manual_seed(0)
    config = ViTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32, num_labels=4
    )
    ViTForImageClassification(config).save_pretrained(folder)
    ViTImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(folder)


def build_workspace(root: Path) -> Workspace:
    """Release folders at test size under the relative names the docs use, and the media they name."""
    write_kimi_vl_folder(root / "path/to/Kimi-VL-A3B-Instruct", tiny_model(), text_hidden_size=32)
    # the hub id the Ray examples load, as a local folder: no network here
    write_kimi_vl_folder(root / "hub/moonshotai/Kimi-VL-A3B-Instruct", tiny_model(), text_hidden_size=32)
    k25 = randomize_(MoonViT(preset_config("tiny", init_pos_emb_time=4))).eval()
    k25_projector = MoonViTProjector(ProjectorConfig.for_encoder(k25.config, 32)).eval()
    write_k25_release_folder(root / "path/to/Kimi-K2.6", k25, k25_projector, processor=MoonViTImageProcessor.kimi_k25())
    k3 = tiny_k3_model(dtype=torch.float32)
    write_k3_release_folder(root / "path/to/Kimi-K3", k3, tiny_k3_projector(k3))
    write_locateanything_folder(root / "path/to/LocateAnything-3B", *tiny_locateanything(dtype=torch.float32))
    write_vit_folder(root / "path/to/vit-base-patch16-224")
    write_openvla_folder(root / "path/to/openvla-7b")  # OpenVLA's keys at test size: patch 4, 16 px
    Image.new("RGB", (70, 42), (200, 40, 90)).save(root / "street.jpg")
    Image.new("RGBA", (30, 58), (20, 90, 200, 128)).save(root / "logo.png")
    if importlib.util.find_spec("av") is not None:  # else the video block is skipped (FILE_NEEDS)
        write_video(root / "drive.mp4", 8, 4.0, size=(40, 30), codec="libx264")
    images = []
    for i, size in enumerate([(60, 44), (33, 90), (120, 70)]):
        images.append(root / "images" / f"img{i}.png")
        images[-1].parent.mkdir(exist_ok=True)
        Image.new("RGB", size, (40 * i, 90, 200)).save(images[-1])
    return Workspace(root, make_checkpoint(root / "checkpoint"), images)


def _pack(ws: Workspace) -> Any:
    return MoonViTImageProcessor.from_pretrained(ws.checkpoint)(ws.images)


def _encoder(ws: Workspace) -> MoonViT:
    return MoonViT.from_pretrained(ws.checkpoint).eval()


def _out(ws: Workspace) -> Any:
    pack = _pack(ws)
    with torch.no_grad():
        return _encoder(ws)(pack.pixel_values, pack.grid_hws)


def _width(ws: Workspace) -> int:
    return MoonViTProjector.from_pretrained(ws.checkpoint).config.text_hidden_size


def _input_ids(ws: Workspace) -> torch.Tensor:
    """A prompt with one ``<|media_pad|>`` per visual token of :data:`GIVEN`'s ``out``, between text."""
    return torch.tensor([[1, 2, *[MEDIA_PAD_TOKEN_ID] * _out(ws).merged.shape[0], 3]])


GIVEN: dict[str, tuple[str, Callable[[Workspace], Any]]] = {
    "folder": ("a checkpoint folder", lambda ws: str(ws.checkpoint)),
    "images": ("the images to encode", lambda ws: ws.images),
    "paths": ("image files", lambda ws: ws.images),
    "pixel_values": ("a processor's packed patches", lambda ws: _pack(ws).pixel_values),
    "grid_hws": ("their (N, 2) grids", lambda ws: _pack(ws).grid_hws),
    "grid_thws": ("their (N, 3) grids", lambda ws: torch.nn.functional.pad(_pack(ws).grid_hws, (1, 0), value=1)),
    "encoder": ("the folder's MoonViT", _encoder),
    "projector": ("the folder's projector", lambda ws: MoonViTProjector.from_pretrained(ws.checkpoint).eval()),
    "processor": ("the folder's processor", lambda ws: MoonViTImageProcessor.from_pretrained(ws.checkpoint)),
    "out": ("the encoder's output on pixel_values", _out),
    "llm": ("a language model of the projector's width", lambda ws: TinyLanguageModel(_width(ws))),
    "input_ids": ("token ids with a placeholder per visual token of out", _input_ids),
}
"""Names a block takes from the prose around it: what each stands for, and its test-size value."""


def substitutions(ws: Workspace) -> dict[str, str]:
    """String literals that name what cannot exist here, and what stands in for each."""
    swaps = {
        "moonshotai/Kimi-VL-A3B-Instruct": str(ws.root / "hub/moonshotai/Kimi-VL-A3B-Instruct"),
        "s3://bucket/images/": str(ws.images_dir),
        "/data/tokens": str(ws.root / "tokens"),
    }
    if not torch.cuda.is_available():
        swaps["cuda"] = "cpu"
    return swaps


class _Substitute(ast.NodeTransformer):
    def __init__(self, swaps: dict[str, str]) -> None:
        self.swaps = swaps

    def visit_Constant(self, node: ast.Constant) -> ast.Constant:
        if isinstance(node.value, str) and node.value in self.swaps:
            return ast.copy_location(ast.Constant(self.swaps[node.value]), node)
        return node


# A block that reads one of these files needs the module that decodes it (an extra of the package).
FILE_NEEDS = {"drive.mp4": "av"}


# ---- Ray ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()


def cpu_map_batches(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Dataset.map_batches`` that hands Ray the call as written, then runs it with one CPU actor.

    The first call only builds the plan, and that is where Ray checks the arguments (in Ray 2.60, a
    call with ``num_gpus`` and no ``batch_size`` is refused): a documented GPU call fails here as it
    would on a GPU cluster. The second keeps every argument but the resources.
    """
    from ray.data import ActorPoolStrategy

    def map_batches(self: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
        original(self, fn, *args, **kwargs)
        if "num_gpus" in kwargs:
            kwargs["num_gpus"] = 0
        if "concurrency" in kwargs:
            kwargs["concurrency"] = 1
        elif "compute" in kwargs:
            kwargs["compute"] = ActorPoolStrategy(size=1)
        return original(self, fn, *args, **kwargs)

    return map_batches


def check_ray_output(ws: Workspace) -> None:
    """What the export example wrote: a row of tokens per image, none failed."""
    import pyarrow.parquet as pq

    table = pq.read_table(ws.root / "tokens").to_pydict()
    assert sorted(Path(p).name for p in table["path"]) == sorted(p.name for p in ws.images)
    assert all(error == "" for error in table["error"]) and all(n > 0 for n in table["token_count"])


# ---- the tests ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Workspace:
    return build_workspace(tmp_path_factory.mktemp("docs"))


@pytest.fixture(autouse=True)
def process_settings_kept():
    """A block may change process-wide settings (the CPU bf16 matmul mode): put them back after it."""
    mode = set_cpu_bf16_matmul("auto")
    set_cpu_bf16_matmul(mode)
    yield
    set_cpu_bf16_matmul(mode)


def test_the_docs_hold_the_examples():
    places = {place.split(":")[0] for block in BLOCKS for place in block.places}
    assert {"README.md", "docs/usage.md", "docs/export.md", "moonvit/ray_data.py"} <= places
    assert len(BLOCKS) >= 10


@pytest.mark.parametrize("block", BLOCKS, ids=[" ".join(b.places) for b in BLOCKS])
def test_every_block_compiles_and_takes_only_given_names(block):
    compile(block.source, block.places[0], "exec")
    unknown = sorted(free_names(block.tree) - set(GIVEN))
    assert not unknown, f"{block.places}: uses {unknown}, neither imported nor defined in the block nor given"


@pytest.mark.parametrize("block", BLOCKS, ids=[" ".join(b.places) for b in BLOCKS])
def test_every_block_runs(block, workspace, monkeypatch, request):
    for module in imported_modules(block.tree) - {"moonvit", "projector", "torch", "numpy", "PIL"}:
        pytest.importorskip(module)
    for name, module in FILE_NEEDS.items():
        if name in block.source:
            pytest.importorskip(module)
    tree = ast.fix_missing_locations(_Substitute(substitutions(workspace)).visit(block.tree))
    if "ray" in imported_modules(tree):
        ray = request.getfixturevalue("local_ray")
        monkeypatch.setattr(ray.data.Dataset, "map_batches", cpu_map_batches(ray.data.Dataset.map_batches))
    monkeypatch.chdir(workspace.root)
    namespace = {name: build(workspace) for name, (_, build) in GIVEN.items() if name in free_names(tree)}
    exec(compile(tree, block.places[0], "exec"), namespace)
    if "write_parquet" in block.source:
        check_ray_output(workspace)


def test_a_gpu_call_without_batch_size_fails_here_as_on_a_gpu_cluster(local_ray):
    """The check the Ray blocks pass is Ray's own: without ``batch_size`` the documented call fails it."""
    from moonvit.ray_data import EncodeImages

    dataset = local_ray.data.from_items([{"image": "a.png"}])
    map_batches = cpu_map_batches(local_ray.data.Dataset.map_batches)
    call = dict(fn_constructor_args=("folder",), compute=local_ray.data.ActorPoolStrategy(size=4), num_gpus=1)
    with pytest.raises(ValueError, match="batch_size"):
        map_batches(dataset, EncodeImages, **call)
    map_batches(dataset, EncodeImages, **call, batch_size=64)  # builds the plan; nothing runs until consumed
