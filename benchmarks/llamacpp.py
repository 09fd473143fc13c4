"""llama.cpp beside this package: its converter, and its ``mtmd`` vision encoder through llama-cpp-python.

For the checks (``benchmarks/llamacpp_check.py``, ``pytest -m llamacpp``), not the library:

- :data:`CONVERTER_WITHOUT_TRANSFORMERS_CONFIG` runs ``convert_hf_to_gguf.py`` reading a release's
  ``config.json`` as it is. With transformers installed, the converter reads the config through
  ``AutoConfig``, and transformers' ``kimi_k25`` config ignores a release's ``vt_*`` keys: every
  K2.5 tower then gets the released sizes (27 x 1152, 16 heads) in its metadata, whatever it is.
- :class:`LlamaCppVision` encodes images with llama.cpp's own graph for an mmproj file. ``mtmd``
  wraps image embeddings in the text model's begin / end tokens, so it needs a text model's
  vocabulary even to encode: :func:`write_text_stub` writes a vocabulary-only one (no weights,
  loaded with ``vocab_only``) whose width is the projector's output width.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

CONVERTER_WITHOUT_TRANSFORMERS_CONFIG = """
import runpy, sys
llama_dir, *argv = sys.argv[1:]
import transformers

class _ConfigJsonAsItIs:
    @staticmethod
    def from_pretrained(*args, **kwargs):
        raise ValueError("read config.json as it is")

transformers.AutoConfig = _ConfigJsonAsItIs
sys.path.insert(0, llama_dir)
sys.argv = [llama_dir + "/convert_hf_to_gguf.py", *argv]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
"""``python -c`` program: ``LLAMA_CPP_DIR FOLDER --mmproj --outtype T --outfile F``."""


def run_converter(llama_cpp_dir: Path, folder: Path, out: Path, outtype: str) -> None:
    """llama.cpp's ``convert_hf_to_gguf.py --mmproj`` on a release folder (with its own ``gguf-py``),
    reading the folder's config.json as it is; raises with the converter's last output on failure."""
    env = {**os.environ, "PYTHONPATH": str(llama_cpp_dir / "gguf-py")}
    command = [sys.executable, "-c", CONVERTER_WITHOUT_TRANSFORMERS_CONFIG, str(llama_cpp_dir), str(folder)]
    command += ["--mmproj", "--outtype", outtype, "--outfile", str(out)]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"llama.cpp's converter failed on {folder}:\n{result.stderr[-3000:]}")


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, tuple[str, list[int], np.ndarray]]]:
    """(key -> value, tensor name -> (GGML type, GGUF shape, data)) of a GGUF file."""
    import gguf

    reader = gguf.GGUFReader(path)
    keys = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {t.name: (t.tensor_type.name, [int(n) for n in t.shape], np.array(t.data)) for t in reader.tensors}
    return keys, tensors


NAMING_KEYS = frozenset({"general.name", "general.size_label", "general.basename", "general.finetune"})
"""Keys the converter derives from the folder's name, not from the weights."""


def gguf_differences(ours: Path, theirs: Path) -> list[str]:
    """How two GGUF files differ (keys other than :data:`NAMING_KEYS`, tensor names, GGML types,
    shapes, bytes); empty when they hold the same model."""
    (ours_keys, ours_tensors), (their_keys, their_tensors) = read_gguf(ours), read_gguf(theirs)
    out = []
    for key in sorted((ours_keys.keys() | their_keys.keys()) - NAMING_KEYS):
        if ours_keys.get(key) != their_keys.get(key):
            out.append(f"key {key}: {ours_keys.get(key)!r} != {their_keys.get(key)!r}")
    for name in sorted(ours_tensors.keys() ^ their_tensors.keys()):
        out.append(f"tensor {name} only in {'ours' if name in ours_tensors else 'theirs'}")
    for name in sorted(ours_tensors.keys() & their_tensors.keys()):
        (kind, shape, data), (their_kind, their_shape, their_data) = ours_tensors[name], their_tensors[name]
        if (kind, shape) != (their_kind, their_shape):
            out.append(f"tensor {name}: {kind} {shape} != {their_kind} {their_shape}")
        elif not np.array_equal(data, their_data):
            out.append(f"tensor {name}: different values")
    return out


MEDIA_TOKENS = ("<|media_begin|>", "<|media_end|>", "<|media_start|>", "<|media_content|>", "<|media_pad|>")


def llama_cpp_available() -> str | None:
    """Why llama-cpp-python with ``mtmd`` cannot be used here, or None."""
    try:
        import llama_cpp  # noqa: F401
        from llama_cpp import mtmd_cpp  # noqa: F401
    except (ImportError, OSError) as error:
        return f"llama-cpp-python with mtmd is not importable ({error})"
    return None


def write_text_stub(path: Path, width: int) -> Path:
    """A vocabulary-only llama GGUF of width ``width``: byte tokens, BOS / EOS and Kimi's media
    markers as control tokens (which ``mtmd`` looks up), no weights."""
    import gguf

    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_context_length(4096)
    writer.add_embedding_length(width)
    writer.add_block_count(1)
    writer.add_feed_forward_length(4 * width)
    writer.add_head_count(1)
    writer.add_head_count_kv(1)
    writer.add_rope_dimension_count(min(width, 128))
    writer.add_layer_norm_rms_eps(1e-5)
    tokens = ["<unk>", "<s>", "</s>", *MEDIA_TOKENS, *(f"<0x{b:02X}>" for b in range(256)), "▁"]
    kinds = [2, 3, 3, *[3] * len(MEDIA_TOKENS), *[6] * 256, 1]  # unknown, control, byte, normal
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(kinds)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class LlamaCppVision:
    """llama.cpp's vision encoder for one mmproj file (CPU, ``threads`` threads).

    ``encode(image)`` returns the image's embeddings (tokens, projection width) as llama.cpp
    computes them for a language model, and the seconds its encode took; ``count(image)`` how many
    there are, from llama.cpp's preprocessing alone.
    """

    def __init__(self, mmproj: Path, text_stub: Path, threads: int, flash_attention: bool = True) -> None:
        import llama_cpp
        from llama_cpp import mtmd_cpp

        self.llama_cpp, self.mtmd = llama_cpp, mtmd_cpp
        llama_cpp.llama_backend_init()
        model_params = llama_cpp.llama_model_default_params()
        model_params.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(str(text_stub).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load the text stub {text_stub}")
        params = mtmd_cpp.mtmd_context_params_default()
        params.use_gpu = False
        params.n_threads = threads
        params.print_timings = False
        params.warmup = False
        params.flash_attn_type = 1 if flash_attention else 0  # LLAMA_FLASH_ATTN_TYPE_ENABLED / DISABLED
        self.ctx = mtmd_cpp.mtmd_init_from_file(str(mmproj).encode(), self.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp's mtmd could not load {mmproj}")
        # The embeddings' width is the projector's (a vocabulary-only text model reports 0).
        self.width = int(read_gguf(mmproj)[0]["clip.vision.projection_dim"])

    @contextmanager
    def _image_chunk(self, image: np.ndarray) -> Iterator[Any]:
        """The image chunk ``mtmd`` makes of an (H, W, 3) uint8 image (its preprocessing applied)."""
        mtmd = self.mtmd
        pixels = np.ascontiguousarray(image, dtype=np.uint8)
        if pixels.ndim != 3 or pixels.shape[2] != 3:
            raise ValueError(f"an image is (H, W, 3) uint8, got {pixels.shape}")
        data = pixels.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        bitmap = mtmd.mtmd_bitmap_init(pixels.shape[1], pixels.shape[0], data)
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            marker = mtmd.mtmd_default_marker()
            text = mtmd.mtmd_input_text(marker, len(marker), False, True)
            bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
            if mtmd.mtmd_tokenize(self.ctx, chunks, ctypes.byref(text), bitmaps, 1) != 0:
                raise RuntimeError("mtmd_tokenize failed")
            kinds = [mtmd.mtmd_input_chunks_get(chunks, i) for i in range(mtmd.mtmd_input_chunks_size(chunks))]
            yield next(chunk for chunk in kinds if mtmd.mtmd_input_chunk_get_type(chunk) == 1)  # the image's
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bitmap)

    def count(self, image: np.ndarray) -> int:
        """How many embeddings llama.cpp gives an (H, W, 3) uint8 image (its preprocessing, no encode)."""
        with self._image_chunk(image) as chunk:
            return int(self.mtmd.mtmd_input_chunk_get_n_tokens(chunk))

    def encode(self, image: np.ndarray) -> tuple[np.ndarray, float]:
        """(tokens, width) float32 embeddings of an (H, W, 3) uint8 image, and the encode's seconds."""
        mtmd = self.mtmd
        with self._image_chunk(image) as chunk:
            tokens = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
            start = time.perf_counter()
            if mtmd.mtmd_encode_chunk(self.ctx, chunk) != 0:
                raise RuntimeError("mtmd_encode_chunk failed")
            seconds = time.perf_counter() - start
            out = mtmd.mtmd_get_output_embd(self.ctx)
            embeddings = np.ctypeslib.as_array(out, shape=(tokens * self.width,)).reshape(tokens, self.width).copy()
        return embeddings, seconds

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.mtmd.mtmd_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            self.llama_cpp.llama_model_free(self.model)
            self.model = None

    def __enter__(self) -> LlamaCppVision:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()
