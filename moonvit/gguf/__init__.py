"""llama.cpp export: a tower and its projector as an mmproj GGUF file that ``mtmd`` runs.

    from moonvit.gguf import export_gguf
    export_gguf(encoder, projector, processor, "mmproj-moonvit-f16.gguf", dtype="f16")
    # llama-mtmd-cli -m LLM.gguf --mmproj mmproj-moonvit-f16.gguf --image photo.jpg -p "..."

``python -m moonvit.gguf --checkpoint DIR --out FILE.gguf`` exports a checkpoint folder (or hub
id). See :mod:`.export` for the two projector types, the dtypes and what is refused; the
``gguf`` package comes with ``pip install "moonvit[gguf]"``.
"""

from .export import (
    GGUF_DTYPES,
    PROJECTOR_TYPES,
    GgufSummary,
    GgufUnavailableError,
    export_gguf,
    split_half_rope_rows,
    tensor_dtype,
)

__all__ = [
    "GGUF_DTYPES",
    "PROJECTOR_TYPES",
    "GgufSummary",
    "GgufUnavailableError",
    "export_gguf",
    "split_half_rope_rows",
    "tensor_dtype",
]
