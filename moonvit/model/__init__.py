"""The network: config, grid metadata, position table, RoPE, attention backends, blocks, encoder.

Read top to bottom: :mod:`.config` (sizes and presets), :mod:`.grid` (everything a
pack's grids determine, computed once per call), :mod:`.position` (the learnable
table and its bicubic taps), :mod:`.rope` (2D rotary embedding), :mod:`.attention`
(the backend registry), :mod:`.linear` (CPU linears: fused epilogues, bf16 widened where the CPU
has no bf16 arithmetic), :mod:`.blocks` (the pre-LN block), :mod:`.encoder` (:class:`MoonViT`),
:mod:`.lora` (LoRA adapters on the blocks' linears, merged back for export),
:mod:`.interface` (what other packages need from an encoder), :mod:`.projector` (merged patches to a
language model's tokens; its checkpoint loader is :mod:`moonvit.weights.projector`).
"""

from .attention import attention_names, register_attention
from .config import PRESETS, MoonViTConfig, preset_config
from .encoder import MoonViT, MoonViTOutput
from .grid import PackedGrid, build_packed_grid, tokens_per_image
from .interface import VisionEncoder
from .linear import cpu_bf16_matmul, cpu_bf16_matmul_mode, set_cpu_bf16_matmul
from .lora import LoRAConfig, LoRALinear, apply_lora, load_adapter, merge_lora, save_adapter
from .projector import MoonViTProjector, ProjectorConfig

__all__ = [
    "PRESETS",
    "LoRAConfig",
    "LoRALinear",
    "MoonViT",
    "MoonViTConfig",
    "MoonViTOutput",
    "MoonViTProjector",
    "PackedGrid",
    "ProjectorConfig",
    "VisionEncoder",
    "apply_lora",
    "attention_names",
    "build_packed_grid",
    "cpu_bf16_matmul",
    "cpu_bf16_matmul_mode",
    "load_adapter",
    "merge_lora",
    "preset_config",
    "register_attention",
    "save_adapter",
    "set_cpu_bf16_matmul",
    "tokens_per_image",
]
