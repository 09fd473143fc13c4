"""ONNX export of the encoder (and its projector): one graph for packs of any size.

    from moonvit.onnx import export_onnx, onnx_inputs
    export_onnx(encoder, "encoder.onnx", projector=None)
    feeds = onnx_inputs(encoder.config, pixel_values, grid_hws)  # NumPy arrays
    last_hidden_state, merged = onnxruntime.InferenceSession("encoder.onnx").run(None, feeds)

:mod:`.inputs` computes a pack's grid-dependent inputs with NumPy, :mod:`.graph` is the
forward that is exported (the model's own modules), :mod:`.export` writes and checks the
graph; ``python -m moonvit.onnx`` exports a checkpoint folder. onnx, onnxscript and
onnxruntime come with ``pip install "moonvit[onnx]"``.
"""

from .export import DEFAULT_OPSET, MAX_OPSET, MIN_OPSET, OnnxUnavailableError, export_onnx, onnx_config, output_names
from .inputs import INPUT_NAMES, input_names, onnx_inputs

__all__ = [
    "DEFAULT_OPSET",
    "INPUT_NAMES",
    "MAX_OPSET",
    "MIN_OPSET",
    "OnnxUnavailableError",
    "export_onnx",
    "input_names",
    "onnx_config",
    "onnx_inputs",
    "output_names",
]
