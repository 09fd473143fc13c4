"""ONNX export of the encoder (and its projector): one graph for packs of any size.

    from moonvit.onnx import export_onnx, onnx_inputs
    export_onnx(encoder, "encoder.onnx", projector=None)
    feeds = onnx_inputs(encoder.config, pixel_values, grid_hws)  # NumPy arrays
    last_hidden_state, merged = onnxruntime.InferenceSession("encoder.onnx").run(None, feeds)

A classic ViT / DeiT tower (:class:`~moonvit.families.vit.ClassicViT`) exports through the same
calls; its graph takes :mod:`.vit_inputs` and returns :func:`vit_output_names`
(``last_hidden_state``, ``prefix_tokens``, ``pooled``, ``logits``, ...).

:mod:`.inputs` computes a pack's grid-dependent inputs with NumPy, :mod:`.graph` is the
forward that is exported (the model's own modules), :mod:`.export` writes and checks the
graph; ``python -m moonvit.onnx`` exports a checkpoint folder. onnx, onnxscript and
onnxruntime come with ``pip install "moonvit[onnx]"``.
"""

from .export import (
    DEFAULT_OPSET,
    MAX_OPSET,
    MIN_OPSET,
    OnnxUnavailableError,
    export_onnx,
    exported_outputs,
    onnx_config,
    output_names,
)
from .inputs import INPUT_NAMES, input_names, onnx_inputs
from .vit_graph import vit_output_names
from .vit_inputs import VIT_INPUT_NAMES

__all__ = [
    "DEFAULT_OPSET",
    "INPUT_NAMES",
    "MAX_OPSET",
    "MIN_OPSET",
    "VIT_INPUT_NAMES",
    "OnnxUnavailableError",
    "export_onnx",
    "exported_outputs",
    "input_names",
    "onnx_config",
    "onnx_inputs",
    "output_names",
    "vit_output_names",
]
