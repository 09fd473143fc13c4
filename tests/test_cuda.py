"""The CUDA paths, at small sizes: ``pytest -m cuda`` on a machine with a GPU (skipped elsewhere).
``benchmarks/cuda_check.py`` runs the same checks on the real tower, with speed."""

import pytest
import torch
from helpers import random_pack, randomize_

from moonvit import MoonViT, preset_config
from moonvit.model.attention import AttentionUnavailableError, flash_attn_installed, resolve_attn_implementation
from moonvit.model.flex import flex_unavailable

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


def varlen_unavailable() -> str | None:
    """Why torch's varlen_attn cannot run here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        resolve_attn_implementation("varlen", torch.device("cuda"), torch.bfloat16)
    except AttentionUnavailableError as error:
        return str(error)
    return None


BACKENDS = ["sdpa", "eager"] + (["flash_attention_2"] if flash_attn_installed() else [])
if varlen_unavailable() is None:
    BACKENDS.append("varlen")
if torch.cuda.is_available() and flex_unavailable(torch.device("cuda"), torch.bfloat16) is None:
    BACKENDS.append("flex")
PACK = [(2, 2), (6, 10), (16, 16), (66, 4), (4, 4)]
CLIPS = [(4, 8, 8), (1, 6, 10), (3, 4, 4)]


def models():
    cpu = randomize_(MoonViT(preset_config("small", init_pos_emb_time=4))).eval()
    gpu = randomize_(MoonViT(preset_config("small", init_pos_emb_time=4))).eval().to("cuda", torch.bfloat16)
    return cpu, gpu


def rel(a, b):
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grids", [PACK, CLIPS], ids=["images", "clips"])
def test_bf16_backends_match_cpu_float32(backend, grids):
    cpu, gpu = models()
    gpu.set_attn_implementation(backend)
    rows = [g if len(g) == 3 else (1, *g) for g in grids]
    pixels, _ = random_pack([(t * h, w) for t, h, w in rows])
    thw = torch.tensor(rows)
    with torch.no_grad():
        expected = cpu(pixels, thw)
        out = gpu(pixels.cuda(), thw)
    assert rel(out.last_hidden_state, expected.last_hidden_state) < 2e-2
    assert rel(out.merged, expected.merged) < 2e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_is_finite(backend):
    _, gpu = models()
    gpu.set_attn_implementation(backend)
    pixels, grids = random_pack(PACK)
    x = pixels.cuda().bfloat16().requires_grad_(True)
    gpu(x, grids).last_hidden_state.float().square().mean().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert all(torch.isfinite(p.grad).all() for p in gpu.parameters() if p.grad is not None)


# ---- torch's varlen FlashAttention against sdpa and eager ------------------------------------------

needs_varlen = pytest.mark.skipif(varlen_unavailable() is not None, reason=str(varlen_unavailable()))
VARLEN_PACKS = {
    "images": ([(1, *g) for g in PACK], ["sdpa", "eager"]),
    "clips": (CLIPS, ["sdpa", "eager"]),
    # one 1792x1792 image (16,384 patches) and a small one: eager's (heads, L, L) scores kept for the
    # backward would take tens of GiB there, so sdpa alone is the peer
    "16k": ([(1, 128, 128), (1, 6, 10)], ["sdpa"]),
}


def forward_backward(model: MoonViT, pixels: torch.Tensor, thw: torch.Tensor) -> dict[str, torch.Tensor]:
    """The output, the pixels' gradient and the parameters' gradients (one vector), of a loss on the
    output."""
    model.zero_grad(set_to_none=True)
    x = pixels.to("cuda", model.dtype).requires_grad_(True)
    out = model(x, thw).last_hidden_state
    out.float().square().mean().backward()
    grads = [p.grad.flatten().float() for p in model.parameters() if p.grad is not None]
    return {"output": out.detach(), "pixel gradient": x.grad, "parameter gradients": torch.cat(grads)}


@needs_varlen
@pytest.mark.parametrize("pack", VARLEN_PACKS)
def test_varlen_matches_sdpa_and_eager_forward_and_gradients(pack):
    """bf16: varlen's output and gradients are as close to the float32 tower's (on the GPU, sdpa) as
    sdpa's and eager's bf16 ones are; the runs differ by bf16 rounding only."""
    rows, peers = VARLEN_PACKS[pack]
    thw = torch.tensor(rows)
    pixels, _ = random_pack([(t * h, w) for t, h, w in rows])
    reference = randomize_(MoonViT(preset_config("small", init_pos_emb_time=4))).eval().to("cuda")
    reference.set_attn_implementation("sdpa")
    exact = forward_backward(reference, pixels, thw)
    model = randomize_(MoonViT(preset_config("small", init_pos_emb_time=4))).eval().to("cuda", torch.bfloat16)
    errors: dict[str, dict[str, float]] = {}
    for backend in ["varlen", *peers]:
        model.set_attn_implementation(backend)
        ours = forward_backward(model, pixels, thw)
        errors[backend] = {what: rel(ours[what], exact[what]) for what in exact}
    for what in exact:
        ours, best = errors["varlen"][what], min(errors[peer][what] for peer in peers)
        assert ours <= 1.5 * best + 2e-3 and ours < 5e-2, f"{what}: {errors}"


@needs_varlen
def test_auto_takes_varlen_where_flash_attn_is_not_installed():
    expected = "flash_attention_2" if flash_attn_installed() else "varlen"
    assert resolve_attn_implementation("auto", torch.device("cuda"), torch.bfloat16) == expected
    assert resolve_attn_implementation("auto", torch.device("cuda"), torch.float32) == "sdpa"


@needs_varlen
def test_varlen_compiles_as_one_graph():
    _, gpu = models()
    gpu.set_attn_implementation("varlen")
    pixels, grids = random_pack(PACK)
    grid = gpu.prepare_grid(grids)
    x = pixels.cuda().bfloat16()
    compiled = torch.compile(gpu, fullgraph=True)
    with torch.no_grad():
        assert rel(compiled(x, grid=grid).last_hidden_state, gpu(x, grid=grid).last_hidden_state) < 1e-2


def test_memory_grows_linearly_with_the_patches():
    _, gpu = models()
    peaks = {}
    for count in (8, 32, 128):
        pixels, grids = random_pack([(16, 16)] * count)
        x = pixels.cuda().bfloat16()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            gpu(x, grids)
        torch.cuda.synchronize()
        peaks[count] = (torch.cuda.max_memory_allocated() - base) / (count * 256)
    assert max(peaks.values()) <= 2 * peaks[8], peaks  # bytes per patch do not grow with the pack


# ---- the trainer on a GPU ------------------------------------------------------------------------------

TRAIN = ["--objective", "supervised", "--preset", "tiny", "--dataset", "digits", "--resolution", "28", "--no-progress"]
TRAIN += ["--batch-patches", "1024", "--evals", "1", "--device", "cuda", "--peak-tflops", "100"]


def test_the_trainer_steps_evaluates_and_exports_on_cuda(tmp_path):
    from moonvit_train.loop import main

    results = main([*TRAIN, "--steps", "4", "--out", str(tmp_path)])
    assert results["steps"] == 4 and results["test"]["top1"] >= 0.0
    assert (tmp_path / "checkpoint" / "model.safetensors").is_file()


def test_torchrun_on_cuda_reduces_host_statistics_through_the_mixed_group(tmp_path):
    """One rank under torchrun on a GPU joins the "cpu:gloo,cuda:nccl" group: the CPU statistics the
    engine reduces (step sums, evaluation, calibration) take gloo, gradients NCCL; with NCCL alone
    the first step's all_reduce of a CPU tensor fails."""
    import subprocess
    import sys
    from pathlib import Path

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m", "moonvit_train", *TRAIN]
    command += ["--minutes", "0.05", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
