"""The projector from MoonViT's merged patches to a language model's embedding space.

Four architectures, chosen by :attr:`ProjectorConfig.projector_type`:

- ``"kimi"``: Kimi-VL's and Kimi-K2.5's projector. LayerNorm over the D features
  of each patch (before the patches of a group are joined), then the kh * kw
  patches of a group concatenated to kh * kw * D, Linear(4D -> 4D), exact (erf)
  GELU, Linear(4D -> text_hidden_size).
- ``"patchmergerv2"``: Kimi K3's. No pre-norm: the kh * kw patches of a group
  concatenated to 4D, Linear(4D -> 4D), exact GELU, Linear(4D -> text_hidden_size),
  both without biases, then RMSNorm(text_hidden_size, eps) after them.
- ``"mlp1"``: NVIDIA LocateAnything-3B's (InternVL's ``mlp1``). The kh * kw patches of a
  group concatenated to 4D first, LayerNorm over that whole 4D vector, Linear(4D ->
  text_hidden_size), exact GELU, Linear(text_hidden_size -> text_hidden_size).
- ``"mlp2x_gelu"``: LLaVA-1.5's projector, for training from scratch. No norm;
  Linear(4D -> text_hidden_size), exact GELU, Linear(text_hidden_size ->
  text_hidden_size) on each flattened merged token.

Checkpoints are read from a local folder or a hub id (only the files holding the
projector fetched, see :mod:`moonvit.weights.hub`) in one of three layouts:

- this project's own: ``projector_config.json`` + ``projector.safetensors``
  (tensor names ``pre_norm.*``, ``linear_1.*``, ``linear_2.*``). The names do
  not clash with the encoder's ``config.json`` / ``model.safetensors`` or the
  processor's ``preprocessor_config.json``, so one folder holds all three.
- Kimi-VL's: ``config.json`` with ``vision_config`` / ``text_config``, tensors
  ``multi_modal_projector.{pre_norm,linear_1,linear_2}.*``.
- Kimi-K2.5's: the same config sections, tensors
  ``mm_projector.{pre_norm,proj.0,proj.2}.*``.
- Kimi K3's: ``mm_projector_type "patchmergerv2"`` in ``vision_config``, tensors
  ``mm_projector.{proj.0,proj.2,post_norm}.weight``.
- LocateAnything-3B's: ``model_type "locateanything"``, tensors ``mlp1.{0,1,3}.*``
  (``mlp1.2`` is the GELU). Its transformers-native layout in review upstream
  (``model.multi_modal_projector.*``) is refused by name.

Kimi checkpoints are usually sharded beside a large language model
(``model.safetensors.index.json``); only the shards that hold projector tensors
are opened, and only those tensors are read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from moonvit.devices import check_device
from moonvit.files import save_safetensors_atomic, write_text_atomic
from moonvit.model.blocks import RMSNorm
from moonvit.model.config import DictConfig, MoonViTConfig, merge_kernel
from moonvit.model.linear import linear
from moonvit.weights.checkpoint import assign_from_files, checkpoint_folder, config_from_file, summarise_names
from moonvit.weights.formats import LOCATEANYTHING
from moonvit.weights.hub import HubSnapshot
from moonvit.weights.storage import CheckpointError, open_tensor_file, read_json, tensor_files, tensor_names

PROJECTOR_TYPES = ("kimi", "patchmergerv2", "mlp1", "mlp2x_gelu")
KIMI_PROJECTOR_TYPES = {"patchmerger": "kimi", "patchmergerv2": "patchmergerv2"}
"""A Kimi config's ``mm_projector_type`` -> this package's ``projector_type``."""
CONFIG_FILE = "projector_config.json"
WEIGHTS_FILE = "projector.safetensors"
# Where Kimi configs keep D, in order of preference: the projector's own input width
# (K2.5), the tower's width (Kimi-VL, transformers), the tower's width (K2.5 remote code).
VISION_HIDDEN_KEYS = ("mm_hidden_size", "hidden_size", "vt_hidden_size")


# ---- configuration ------------------------------------------------------------------


@dataclass
class ProjectorConfig(DictConfig):
    """Hyper-parameters of a :class:`MoonViTProjector`.

    The defaults are Kimi-VL-A3B's projector (MoonViT-SO-400M into a 2048-wide LLM).

    Attributes:
        projector_type: ``"kimi"``, ``"patchmergerv2"``, ``"mlp1"`` or ``"mlp2x_gelu"`` (see the module docstring).
        vision_hidden_size: D, the encoder's per-patch width.
        text_hidden_size: the language model's embedding width (the output width).
        merge_kernel_size: (kh, kw), patches per merged token along rows and columns.
        layer_norm_eps: epsilon of the ``"kimi"`` and ``"mlp1"`` pre-norms, or of the ``"patchmergerv2"`` post-norm.
    """

    projector_type: str = "kimi"
    vision_hidden_size: int = 1152
    text_hidden_size: int = 2048
    merge_kernel_size: tuple[int, int] = (2, 2)
    layer_norm_eps: float = 1e-5
    model_type: str = field(default="moonvit_projector", init=False)

    def __post_init__(self) -> None:
        self.merge_kernel_size = merge_kernel(self.merge_kernel_size)
        if self.projector_type not in PROJECTOR_TYPES:
            raise ValueError(f"projector_type must be one of {PROJECTOR_TYPES}, got {self.projector_type!r}")
        for name in ("vision_hidden_size", "text_hidden_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def patches_per_token(self) -> int:
        """kh * kw, the patches joined into one merged token."""
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @property
    def merged_hidden_size(self) -> int:
        """kh * kw * D, the width of a flattened merged token."""
        return self.patches_per_token * self.vision_hidden_size

    @property
    def intermediate_size(self) -> int:
        """Width between the two linears: 4D for the Kimi projectors, text_hidden_size for ``"mlp1"`` and
        ``"mlp2x_gelu"``."""
        return self.text_hidden_size if self.projector_type in ("mlp1", "mlp2x_gelu") else self.merged_hidden_size

    @property
    def pre_norm_size(self) -> int | None:
        """The pre-norm's width: D (``"kimi"``: each patch), 4D (``"mlp1"``: each merged token), or None."""
        return {"kimi": self.vision_hidden_size, "mlp1": self.merged_hidden_size}.get(self.projector_type)

    @property
    def bias(self) -> bool:
        """Whether the linears have biases (Kimi K3's have none)."""
        return self.projector_type != "patchmergerv2"

    @classmethod
    def for_encoder(cls, encoder_config: MoonViTConfig, text_hidden_size: int, **overrides: Any) -> ProjectorConfig:
        """The config that fits ``encoder_config``'s width and merge kernel, for a new projector."""
        return cls(
            vision_hidden_size=encoder_config.hidden_size,
            merge_kernel_size=encoder_config.merge_kernel_size,
            text_hidden_size=text_hidden_size,
            **overrides,
        )


# ---- the module -----------------------------------------------------------------------


class MoonViTProjector(nn.Module):
    """Maps MoonViT's merged patch groups to language-model tokens.

    Call it on the encoder's ``out.merged`` (N, kh * kw, D) to get (N, text_hidden_size),
    one LLM token per merged token, images in the encoder's packing order.
    """

    def __init__(self, config: ProjectorConfig) -> None:
        super().__init__()
        self.config = config
        norm, v2 = config.pre_norm_size, config.projector_type == "patchmergerv2"
        self.pre_norm = None if norm is None else nn.LayerNorm(norm, eps=config.layer_norm_eps)
        self.linear_1 = nn.Linear(config.merged_hidden_size, config.intermediate_size, bias=config.bias)
        self.linear_2 = nn.Linear(config.intermediate_size, config.text_hidden_size, bias=config.bias)
        self.post_norm = RMSNorm(config.text_hidden_size, eps=config.layer_norm_eps) if v2 else None

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> MoonViTProjector:
        """Load from a local folder or hub id: this project's format, a Kimi-VL, Kimi-K2.5, Kimi K3 or
        LocateAnything-3B checkpoint.

        ``projector_config.json``, where present, is read in preference to a
        Kimi ``config.json``. Only the projector's tensors are read; ``dtype``
        defaults to the checkpoint's. The model is returned in eval mode.

        Raises:
            CheckpointError: no such folder (or a file), no config or projector tensors, an
                unsupported projector, a corrupt file, or tensors that are missing,
                unexpected or of the wrong shape (all of them named).
            ValueError: a ``device`` this torch cannot reach.
        """
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

    def save_pretrained(self, path: str | Path) -> None:
        """Write ``projector_config.json`` and ``projector.safetensors`` to the folder ``path``.

        The folder may also hold the encoder's and the processor's files.
        """
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        write_text_atomic(folder / CONFIG_FILE, json.dumps(self.config.to_dict(), indent=2) + "\n")
        state = {name: tensor.detach().cpu() for name, tensor in self.state_dict().items()}
        save_safetensors_atomic(state, folder / WEIGHTS_FILE)

    @property
    def dtype(self) -> torch.dtype:
        return self.linear_1.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.linear_1.weight.device

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        """Project merged patch groups to language-model tokens.

        Args:
            merged: (..., kh * kw, D) floating, e.g. the encoder's ``out.merged``
                (L / 4, 4, D); cast to the projector's dtype.

        Returns:
            (..., text_hidden_size) in the projector's dtype.
        """
        self._check_input(merged)
        x = merged.to(self.dtype)
        per_patch = self.config.projector_type == "kimi"  # Kimi normalises each patch, mlp1 the joined token
        if self.pre_norm is not None and per_patch:
            x = self.pre_norm(x)
        x = x.flatten(-2)
        if self.pre_norm is not None and not per_patch:
            x = self.pre_norm(x)
        rows = x.reshape(-1, x.shape[-1])  # (tokens, kh * kw * D)
        # moonvit's CPU linear: bf16 widened to float32 where the CPU has no bf16 arithmetic
        x = linear(self.linear_2, F.gelu(linear(self.linear_1, rows))).reshape(*x.shape[:-1], -1)
        return x if self.post_norm is None else self.post_norm(x)

    def _check_input(self, merged: torch.Tensor) -> None:
        expected = (self.config.patches_per_token, self.config.vision_hidden_size)
        if not isinstance(merged, torch.Tensor):
            raise TypeError(f"the projector's input must be a tensor, got {type(merged).__name__}")
        if not merged.dtype.is_floating_point:
            raise TypeError(f"the projector's input must be floating, got {merged.dtype}")
        if merged.ndim < 2 or tuple(merged.shape[-2:]) != expected:
            raise ValueError(
                f"the projector expects merged patch groups of shape (..., {expected[0]}, {expected[1]}) "
                f"(the encoder's out.merged), got {tuple(merged.shape)}"
            )
        if merged.device != self.device:
            raise ValueError(f"the projector's input is on {merged.device}, the projector on {self.device}")


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
