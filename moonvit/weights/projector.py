"""Reading a :class:`~moonvit.model.projector.MoonViTProjector` from a checkpoint, and its part of a release.

Layouts (how each release names the projector's modules), the configs of Kimi-VL,
Kimi-K2.5, Kimi K3 and LocateAnything-3B read as a :class:`ProjectorConfig`, and
:func:`load_projector`, which :meth:`MoonViTProjector.from_pretrained` calls. The
layouts themselves are described in :mod:`moonvit.model.projector`. For writing a release
(:mod:`.release`): :func:`release_projector_layout` and :func:`projector_config_to_json`, the
inverses of the same tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..devices import check_device
from ..model.projector import CONFIG_FILE, WEIGHTS_FILE, MoonViTProjector, ProjectorConfig
from .checkpoint import assign_from_files, checkpoint_folder, config_from_file, summarise_names
from .formats import LOCATEANYTHING
from .storage import CheckpointError, open_tensor_file, read_json, tensor_files, tensor_names

if TYPE_CHECKING:
    from .hub import HubSnapshot

KIMI_PROJECTOR_TYPES = {"patchmerger": "kimi", "patchmergerv2": "patchmergerv2"}
"""A Kimi config's ``mm_projector_type`` -> this package's ``projector_type``."""
# Where Kimi configs keep D, in order of preference: the projector's own input width
# (K2.5), the tower's width (Kimi-VL, transformers), the tower's width (K2.5 remote code).
VISION_HIDDEN_KEYS = ("mm_hidden_size", "hidden_size", "vt_hidden_size")


def load_projector(
    cls: type[MoonViTProjector],
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> MoonViTProjector:
    """Build ``cls`` from a checkpoint folder or hub id, reading only the projector's tensors
    (see :meth:`MoonViTProjector.from_pretrained`)."""
    if device is not None:
        device = check_device(device)
    folder = checkpoint_folder(path, _fetch_projector_files)
    if (folder / CONFIG_FILE).is_file():
        config, layout, files = _read_own_format(folder)
    elif (folder / "config.json").is_file():
        config = _config_from_kimi(read_json(folder / "config.json"), folder)
        layout, files = _find_kimi_projector(folder, config.projector_type)
    else:
        raise CheckpointError(f"{folder} has neither {CONFIG_FILE} nor config.json")
    with torch.device("meta"):
        model = cls(config)
    return assign_from_files(model, files, layout.checkpoint_name, folder, dtype, device)


# ---- checkpoint layouts ------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """How a checkpoint names the projector's modules.

    Attributes:
        name: what the layout is called in messages.
        modules: this project's module name -> the checkpoint's full module name.
    """

    name: str
    modules: dict[str, str]

    def checkpoint_name(self, name: str) -> str:
        """``linear_1.weight`` -> e.g. ``mm_projector.proj.0.weight``."""
        module, kind = name.rsplit(".", 1)
        return f"{self.modules[module]}.{kind}"

    @property
    def roots(self) -> tuple[str, ...]:
        """The name prefixes of its projector modules (``mm_projector.``, ``mlp1.``, ...)."""
        return tuple(sorted({_root(module) for module in self.modules.values()}))


def _root(module: str) -> str:
    """``mm_projector.proj.0`` -> ``mm_projector.``; a module outside a ``*projector`` (``mlp1.0``) -> ``mlp1.``."""
    if "projector." in module:
        return module[: module.index("projector.") + len("projector.")]
    return module.split(".", 1)[0] + "."


OWN_LAYOUT = Layout(
    "moonvit", {"pre_norm": "pre_norm", "linear_1": "linear_1", "linear_2": "linear_2", "post_norm": "post_norm"}
)
KIMI_VL_LAYOUT = Layout(
    "Kimi-VL",
    {"pre_norm": "multi_modal_projector.pre_norm", "linear_1": "multi_modal_projector.linear_1",
     "linear_2": "multi_modal_projector.linear_2"},
)  # fmt: skip
KIMI_K25_LAYOUT = Layout(
    "Kimi-K2.5 release",
    {"pre_norm": "mm_projector.pre_norm", "linear_1": "mm_projector.proj.0", "linear_2": "mm_projector.proj.2"},
)
# transformers' in-memory names, and what its save_pretrained writes (one module renamed back only).
KIMI_K25_NATIVE_LAYOUT = Layout(
    "Kimi-K2.5 transformers",
    {"pre_norm": "model.mm_projector.pre_norm", "linear_1": "model.mm_projector.in_proj",
     "linear_2": "model.mm_projector.out_proj"},
)  # fmt: skip
KIMI_K25_HYBRID_LAYOUT = Layout(
    "Kimi-K2.5 transformers-saved",
    {"pre_norm": "model.mm_projector.pre_norm", "linear_1": "mm_projector.proj.0", "linear_2": "mm_projector.proj.2"},
)
KIMI_K3_LAYOUT = Layout(
    "Kimi K3 release",
    {"linear_1": "mm_projector.proj.0", "linear_2": "mm_projector.proj.2", "post_norm": "mm_projector.post_norm"},
)
LOCATEANYTHING_LAYOUT = Layout("LocateAnything-3B", {"pre_norm": "mlp1.0", "linear_1": "mlp1.1", "linear_2": "mlp1.3"})
KIMI_LAYOUTS = (KIMI_VL_LAYOUT, KIMI_K25_LAYOUT, KIMI_K25_NATIVE_LAYOUT, KIMI_K25_HYBRID_LAYOUT, KIMI_K3_LAYOUT)
RELEASE_LAYOUTS = (*KIMI_LAYOUTS, LOCATEANYTHING_LAYOUT)
LAYOUTS_OF_TYPE = {"kimi": KIMI_LAYOUTS[:4], "patchmergerv2": (KIMI_K3_LAYOUT,), "mlp1": (LOCATEANYTHING_LAYOUT,)}
"""The layouts a release config's projector type may be stored in."""
RELEASE_PROJECTORS = {
    ("kimi-vl", "kimi"): KIMI_VL_LAYOUT,
    ("kimi-k25", "kimi"): KIMI_K25_LAYOUT,
    ("kimi-k3", "patchmergerv2"): KIMI_K3_LAYOUT,
    (LOCATEANYTHING, "mlp1"): LOCATEANYTHING_LAYOUT,
}
"""(release family, ``projector_type``) -> the layout that release keeps its projector in."""
EXPECTED_TENSORS = {
    "kimi": "multi_modal_projector.* for Kimi-VL, mm_projector.* or model.mm_projector.* for Kimi-K2.5",
    "patchmergerv2": "mm_projector.proj.0, mm_projector.proj.2 and mm_projector.post_norm for Kimi K3",
    "mlp1": "mlp1.0, mlp1.1 and mlp1.3 for LocateAnything-3B",
}


def _read_own_format(folder: Path) -> tuple[ProjectorConfig, Layout, dict[Path, list[str]]]:
    """The config of this project's format, and its one tensor file with the names it holds."""
    config = config_from_file(ProjectorConfig, read_json(folder / CONFIG_FILE), folder / CONFIG_FILE)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{folder} has {CONFIG_FILE} but no {WEIGHTS_FILE}")
    with open_tensor_file(weights) as f:
        return config, OWN_LAYOUT, {weights: list(f.keys())}


def _fetch_projector_files(snapshot: HubSnapshot) -> None:
    """From a hub repository: this project's two files, or config.json and the shards holding a
    Kimi projector's tensors. Offline, an uncached projector_config.json counts as absent: Kimi
    releases have none, and this project's folders fail loudly without it."""
    if snapshot.optional_file(CONFIG_FILE, unknown="absent") is not None:
        snapshot.file(WEIGHTS_FILE)
        return
    snapshot.file("config.json")
    snapshot.tensors(*{root for layout in RELEASE_LAYOUTS for root in layout.roots})


def _config_from_kimi(values: dict[str, Any], folder: Path) -> ProjectorConfig:
    """The projector config of a Kimi-VL, Kimi-K2.5 or Kimi K3 ``config.json``: ``"kimi"`` for
    ``mm_projector_type "patchmerger"`` (or none), ``"patchmergerv2"`` for K3's.

    D is read from ``vision_config`` (``mm_hidden_size``, ``hidden_size`` or K2.5's
    release ``vt_hidden_size``) or transformers' top-level ``projection_hidden_size``;
    the output width from ``text_config.hidden_size`` (or K2.5's
    ``vision_config.text_hidden_size``); the norm's eps (K2.5's pre-norm, K3's post-norm) from
    ``projector_ln_eps`` / ``projection_layer_norm_eps``.
    """
    vision, text = values.get("vision_config"), values.get("text_config") or {}
    if not isinstance(vision, dict) or not isinstance(text, dict):
        raise CheckpointError(
            f"{folder}/config.json has no vision_config and text_config (not a Kimi-VL, K2.5, K3 or "
            f"LocateAnything checkpoint), and {folder} has no {CONFIG_FILE}"
        )
    if values.get("model_type") == LOCATEANYTHING:
        return _config_from_locateanything(values, vision, text, folder)
    kind = vision.get("mm_projector_type", "patchmerger")
    activation = vision.get("projector_hidden_act", "gelu")
    if kind not in KIMI_PROJECTOR_TYPES or activation != "gelu":
        raise CheckpointError(
            f"{folder}/config.json describes an unsupported projector "
            f"(mm_projector_type {kind!r}, projector_hidden_act {activation!r}); "
            f"only {' and '.join(map(repr, KIMI_PROJECTOR_TYPES))} with exact 'gelu' are implemented"
        )
    vision_hidden = next((vision[k] for k in VISION_HIDDEN_KEYS if vision.get(k)), None)
    vision_hidden = values.get("projection_hidden_size") or vision_hidden
    text_hidden = text.get("hidden_size", vision.get("text_hidden_size"))
    if vision_hidden is None or text_hidden is None:
        raise CheckpointError(
            f"{folder}/config.json lacks the vision width (vision_config.{' / '.join(VISION_HIDDEN_KEYS)}) "
            "or the text width (text_config.hidden_size)"
        )
    try:
        return ProjectorConfig(
            projector_type=KIMI_PROJECTOR_TYPES[kind],
            vision_hidden_size=vision_hidden,
            text_hidden_size=text_hidden,
            merge_kernel_size=vision.get("merge_kernel_size", (2, 2)),
            layer_norm_eps=vision.get("projector_ln_eps", values.get("projection_layer_norm_eps", 1e-5)),
        )
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{folder}/config.json: {error}") from error


def _config_from_locateanything(
    values: dict[str, Any], vision: dict[str, Any], text: dict[str, Any], folder: Path
) -> ProjectorConfig:
    """LocateAnything-3B's ``mlp1``: D from ``vision_config.hidden_size``, the output width from
    ``text_config.hidden_size``; its two linears are what ``mlp_connector_layers 2`` says."""
    layers = values.get("mlp_connector_layers", 2)
    if layers != 2:
        raise CheckpointError(
            f"{folder}/config.json: mlp_connector_layers {layers!r} is not supported (LocateAnything's mlp1 has 2)"
        )
    if "hidden_size" not in vision or "hidden_size" not in text:
        raise CheckpointError(f"{folder}/config.json lacks vision_config.hidden_size or text_config.hidden_size")
    try:
        return ProjectorConfig(
            projector_type="mlp1",
            vision_hidden_size=vision["hidden_size"],
            text_hidden_size=text["hidden_size"],
            merge_kernel_size=vision.get("merge_kernel_size", (2, 2)),
        )
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{folder}/config.json: {error}") from error


def _find_kimi_projector(folder: Path, projector_type: str) -> tuple[Layout, dict[Path, list[str]]]:
    """The layout (of those ``projector_type`` is stored in) whose tensors the folder holds, and the
    files that hold them (only those)."""
    present = set(tensor_names(folder))
    layouts = LAYOUTS_OF_TYPE[projector_type]
    for layout in layouts:
        wanted = {layout.checkpoint_name(f"{module}.weight") for module in layout.modules}
        if wanted <= present:
            return layout, tensor_files(folder, layout.roots)
    found = sorted(name for name in present if "projector." in name or name.startswith("mlp1."))
    if projector_type == "mlp1" and any(name.startswith("model.multi_modal_projector.") for name in found):
        raise CheckpointError(
            f"{folder} is in LocateAnything's transformers-native layout (model.multi_modal_projector.*, a post-merge "
            "norm), which this package does not load; load the release folder (tensors mlp1.0, mlp1.1, mlp1.3)"
        )
    raise CheckpointError(
        f"{folder} holds no projector tensors ({EXPECTED_TENSORS[projector_type]})"
        + (f"; its projector tensors are {summarise_names(found)}" if found else "")
    )


# ---- writing a release ----------------------------------------------------------------------


def release_projector_layout(family: str, projector_type: str) -> Layout:
    """The layout a ``family`` release (see :data:`~.formats.RELEASE_FAMILIES`) keeps a projector of
    ``projector_type`` in.

    Raises:
        ValueError: no release pairs that tower family with that projector (a K2.5 tower with
            LocateAnything's ``mlp1``, a LLaVA ``mlp2x_gelu`` projector anywhere), both named.
    """
    layout = RELEASE_PROJECTORS.get((family, projector_type))
    if layout is None:
        pairs = ", ".join(f"{tower} + {kind!r}" for tower, kind in RELEASE_PROJECTORS)
        raise ValueError(f"no release holds a {family} tower with a {projector_type!r} projector (releases: {pairs})")
    return layout


def projector_config_to_json(config: ProjectorConfig, family: str) -> dict[str, Any]:
    """The projector's part of a ``family`` release's ``config.json``: the keys :func:`_config_from_kimi`
    reads, where that release keeps them (K2.5's and K3's ``mm_*`` fields inside ``vision_config``,
    LocateAnything's ``mlp_connector_layers`` at the top level, the output width as
    ``text_config.hidden_size``). Kimi-VL's and LocateAnything's configs hold no eps: theirs is 1e-5."""
    release_projector_layout(family, config.projector_type)  # a pairing no release has is refused
    values: dict[str, Any] = {"text_config": {"hidden_size": config.text_hidden_size}}
    if family == LOCATEANYTHING:
        values["mlp_connector_layers"] = 2
    elif family in ("kimi-k25", "kimi-k3"):
        kimi_type = {ours: theirs for theirs, ours in KIMI_PROJECTOR_TYPES.items()}[config.projector_type]
        values["vision_config"] = {
            "mm_projector_type": kimi_type,
            "mm_hidden_size": config.vision_hidden_size,
            "text_hidden_size": config.text_hidden_size,
            "projector_hidden_act": "gelu",
            "projector_ln_eps": config.layer_norm_eps,
        }
    return values


def projector_config_from_json(values: dict[str, Any], folder: Path) -> ProjectorConfig:
    """The projector config a release ``config.json`` (``values``, in ``folder``) reads as: what
    :func:`load_projector` reads from a folder without :data:`CONFIG_FILE`."""
    return _config_from_kimi(values, folder)
