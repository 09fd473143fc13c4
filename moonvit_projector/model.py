"""The projector model, which lives in the library: :mod:`moonvit.model.projector` (the module and its
config) and :mod:`moonvit.weights.projector` (the checkpoint layouts and the loader).

Re-exported here so that ``from moonvit_projector.model import ...`` keeps working.
"""

from moonvit.model.projector import CONFIG_FILE, PROJECTOR_TYPES, WEIGHTS_FILE, MoonViTProjector, ProjectorConfig
from moonvit.weights.projector import (
    EXPECTED_TENSORS,
    KIMI_K3_LAYOUT,
    KIMI_K25_HYBRID_LAYOUT,
    KIMI_K25_LAYOUT,
    KIMI_K25_NATIVE_LAYOUT,
    KIMI_LAYOUTS,
    KIMI_PROJECTOR_TYPES,
    KIMI_VL_LAYOUT,
    LAYOUTS_OF_TYPE,
    LOCATEANYTHING_LAYOUT,
    OWN_LAYOUT,
    RELEASE_LAYOUTS,
    VISION_HIDDEN_KEYS,
    Layout,
    _config_from_kimi,
    _config_from_locateanything,
    _fetch_projector_files,
    _find_kimi_projector,
    _read_own_format,
    _root,
    load_projector,
)

__all__ = [
    "CONFIG_FILE",
    "EXPECTED_TENSORS",
    "KIMI_K25_HYBRID_LAYOUT",
    "KIMI_K25_LAYOUT",
    "KIMI_K25_NATIVE_LAYOUT",
    "KIMI_K3_LAYOUT",
    "KIMI_LAYOUTS",
    "KIMI_PROJECTOR_TYPES",
    "KIMI_VL_LAYOUT",
    "LAYOUTS_OF_TYPE",
    "LOCATEANYTHING_LAYOUT",
    "OWN_LAYOUT",
    "PROJECTOR_TYPES",
    "RELEASE_LAYOUTS",
    "VISION_HIDDEN_KEYS",
    "WEIGHTS_FILE",
    "Layout",
    "MoonViTProjector",
    "ProjectorConfig",
    "_config_from_kimi",
    "_config_from_locateanything",
    "_fetch_projector_files",
    "_find_kimi_projector",
    "_read_own_format",
    "_root",
    "load_projector",
]
