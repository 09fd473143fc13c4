"""Weight formats: reading and writing checkpoint folders, and transformers interop.

:mod:`.checkpoint` reads Kimi-VL releases and this project's own folders (only the
vision tensors, from local shards) and writes the latter; :mod:`.hub` turns a hub
id into a local snapshot holding only the files a loader reads; :mod:`.transformers`
builds transformers' ``Kimi_K25VisionModel`` from an encoder, the independent
peer used by the parity tests and the benchmark.
"""

from .checkpoint import update_weights_digest
from .storage import CheckpointError

__all__ = ["CheckpointError", "update_weights_digest"]
