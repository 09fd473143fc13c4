"""The ``openvino`` backend: OpenVINO's bf16 attention on long items, as close to float64 as torch's
SDPA once q comes scaled in its rotation; short items keep sdpa's bits; q, k, v handed over as one
buffer; no OpenVINO under autograd; what ``auto`` picks and what is refused."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import random_pack, tiny_model, with_threads

from moonvit.model import attention, openvino_sdpa
from moonvit.model.attention import AttentionUnavailableError, resolve_attn_implementation
from moonvit.model.linear import cpu_has_bf16_arithmetic as host_has_bf16_arithmetic
from moonvit.model.openvino_sdpa import OPENVINO_MIN_PATCHES

pytest.importorskip("openvino")

CPU = torch.device("cpu")


REAL_CPU_HOST = openvino_sdpa.cpu_host


def zen4_like() -> openvino_sdpa.CpuHost:
    """This host's facts, its CPU taken for the class where ``auto`` picks OpenVINO's attention
    (AVX512-BF16, no AMX: AMD Zen 4)."""
    return dataclasses.replace(REAL_CPU_HOST(), amx=False, avx512_bf16=True)


@pytest.fixture(autouse=True)
def bf16_cpu(monkeypatch):
    """Every host runs these: on a CPU without bf16 arithmetic OpenVINO computes in float32 (slower,
    the same answers), where the backend is otherwise refused; and ``auto`` sees the host class it
    picks OpenVINO on (an AMX host's choice is tested on its own)."""
    monkeypatch.setattr(openvino_sdpa, "cpu_has_bf16_arithmetic", lambda: True)
    monkeypatch.setattr(openvino_sdpa, "cpu_host", zen4_like)


@pytest.fixture
def ov_calls(monkeypatch):
    """The shapes of q in each call that reaches OpenVINO."""
    calls: list[tuple[int, ...]] = []
    real = attention.openvino_sdpa

    def spy(q, k, v, scale=None):
        calls.append(tuple(q.shape))
        return real(q, k, v, scale)

    monkeypatch.setattr(attention, "openvino_sdpa", spy)
    return calls


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_prescaled_q_makes_openvino_as_close_to_float64_as_torch():
    """q as RoPE leaves it, in float32 before its rounding; logits spread over about +-10 as in a
    trained tower. torch's SDPA rounds q once; OpenVINO given q * scale rounded once is as close;
    left to scale a rounded q itself it rounds twice and lands further off (why the encoder prescales)."""
    torch.manual_seed(0)
    heads, head_dim, n = 4, 72, OPENVINO_MIN_PATCHES
    q, k, v = (torch.randn(1, n, heads, head_dim) for _ in range(3))
    q, k = q * 1.8, (k * 1.8).bfloat16()
    v = v.bfloat16()
    scale = head_dim**-0.5
    rows = slice(0, 256)
    logits = torch.einsum("qhd,khd->hqk", q[0, rows].double(), k[0].double()) * scale
    exact = torch.einsum("hqk,khd->qhd", logits.softmax(-1), v[0].double())
    own = rel(exact.bfloat16(), exact)  # the bf16 answer's own error, about 1.7e-3
    errors = {
        "sdpa": rel(attention.sdpa_group(q.bfloat16(), k, v)[0, rows], exact),
        "openvino, q prescaled": rel(openvino_sdpa.openvino_sdpa((q * scale).bfloat16(), k, v, 1.0)[0, rows], exact),
        "openvino, q rounded then scaled": rel(openvino_sdpa.openvino_sdpa(q.bfloat16(), k, v)[0, rows], exact),
    }
    # measured: sdpa 3.8e-3, prescaled 4.1e-3 (within the answer's own error of sdpa's), rounded twice 5.2e-3
    assert errors["openvino, q prescaled"] <= errors["sdpa"] + 0.5 * own, errors
    if host_has_bf16_arithmetic():  # elsewhere OpenVINO may compute in float32: then nothing is rounded twice
        assert errors["openvino, q rounded then scaled"] >= 1.15 * errors["openvino, q prescaled"], errors


def test_a_long_item_goes_through_openvino_as_accurately_as_sdpa_and_short_items_keep_sdpa_bits(ov_calls):
    """One pack: two items of 1,024 patches (one OpenVINO call per block for both) and two short ones."""
    exact_model, model = tiny_model(seed=3), tiny_model(seed=3, dtype=torch.bfloat16)
    grids = [(32, 32), (4, 4), (32, 32), (2, 6)]
    pixels, grid_hws = random_pack(grids, seed=1)
    with torch.no_grad():
        exact = exact_model(pixels, grid_hws).last_hidden_state
        outputs = {}
        for name in ("sdpa", "openvino"):
            model.set_attn_implementation(name)
            outputs[name] = model(pixels.bfloat16(), grid_hws).last_hidden_state
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    assert ov_calls == [(2, 1024, config.num_attention_heads, head_dim)] * config.num_hidden_layers
    item = torch.repeat_interleave(torch.arange(len(grids)), torch.tensor([h * w for h, w in grids]))
    long_rows, short_rows = item.unsqueeze(1).eq(torch.tensor([0, 2])).any(1), item.eq(1) | item.eq(3)
    errors = {name: rel(out[long_rows], exact[long_rows]) for name, out in outputs.items()}
    assert errors["openvino"] <= 1.1 * errors["sdpa"], errors
    assert not torch.equal(outputs["openvino"][long_rows], outputs["sdpa"][long_rows])
    assert torch.equal(outputs["openvino"][short_rows], outputs["sdpa"][short_rows])


def test_a_pack_of_short_items_is_sdpa_bit_for_bit(ov_calls):
    model = tiny_model(seed=1, dtype=torch.bfloat16)
    pixels, grid_hws = random_pack([(16, 16), (10, 14)], seed=2)
    with torch.no_grad():
        outputs = {}
        for name in ("sdpa", "openvino"):
            model.set_attn_implementation(name)
            outputs[name] = model(pixels.bfloat16(), grid_hws).merged
    assert ov_calls == []
    assert torch.equal(outputs["openvino"], outputs["sdpa"])


def test_q_k_v_from_one_buffer_go_in_as_it_and_others_as_a_copy_with_the_same_bits():
    """The encoder's q, k, v are the thirds of wqkv's output (L, 3, heads, head_dim): OpenVINO reads that
    buffer itself. q, k, v from anywhere else are stacked into one, held until OpenVINO is done with it."""
    torch.manual_seed(0)
    items, seqlen, heads, head_dim = 2, OPENVINO_MIN_PATCHES, 4, 72
    qkv = torch.randn(5 + items * seqlen, 3, heads, head_dim).bfloat16()[5:]  # not at its storage's start
    q, k, v = (qkv[:, i].reshape(items, seqlen, heads, head_dim) for i in range(3))
    whole = openvino_sdpa._stacked(q, k, v)
    assert whole.data_ptr() == qkv.data_ptr() and torch.equal(whole, qkv.view(whole.shape))
    separate = [t.contiguous() for t in (q, k, v)]
    copy = openvino_sdpa._stacked(*separate)
    assert copy.data_ptr() != separate[0].data_ptr() and torch.equal(copy, whole)
    out = openvino_sdpa.openvino_sdpa(q, k, v, 1.0)
    for _ in range(3):  # a copy freed too early would let OpenVINO read memory reused since
        assert torch.equal(openvino_sdpa.openvino_sdpa(*separate, 1.0), out)
    expected = attention.sdpa_group(q.float(), k.float(), v.float(), 1.0)
    assert rel(out, expected) < 1e-2


def test_bound_without_prescaling_it_scales_q_itself():
    """A caller that binds the backend on its own (no prescaled q) gets attention with the usual scale."""
    torch.manual_seed(0)
    model = tiny_model()
    grid = model.prepare_grid(torch.tensor([[1, 32, 32], [1, 4, 4]]))
    q, k, v = (torch.randn(len(grid.item_index), 2, 24).bfloat16() for _ in range(3))
    ours = attention.bind_attention("openvino", grid)(q, k, v)
    reference = attention.bind_attention("eager", grid)(*(t.double() for t in (q, k, v)))
    assert rel(ours, reference) < 1e-2


@pytest.mark.parametrize("name", ["openvino", "auto"])
@pytest.mark.parametrize("trained", ["weights", "pixels"])
def test_under_autograd_a_forward_is_sdpa_bit_for_bit(ov_calls, name, trained):
    """OpenVINO has no backward: a forward autograd records (weights trained, or only the pixels'
    gradient asked for) runs as sdpa, long items' q unscaled: the same outputs and gradients, to the bit,
    whether OpenVINO is installed or not."""
    pixels, grid_hws = random_pack([(32, 32), (2, 4)], seed=5, dtype=torch.bfloat16)
    # head_dim 32: its scale 32 ** -0.5 is inexact (tiny's 16 ** -0.5 would round nothing)
    model = tiny_model(seed=2, dtype=torch.bfloat16, num_attention_heads=2).train()
    model.requires_grad_(trained == "weights")
    results = {}
    for backend in ("sdpa", name):
        model.set_attn_implementation(backend)
        model.zero_grad(set_to_none=True)
        x = pixels.clone().requires_grad_(trained == "pixels")
        out = model(x, grid_hws).merged
        out.float().square().sum().backward()
        grads = [x.grad] if trained == "pixels" else [p.grad for p in model.parameters()]
        results[backend] = (out.detach(), grads)
    assert ov_calls == []
    (out_sdpa, grads_sdpa), (out_ours, grads_ours) = results["sdpa"], results[name]
    assert torch.equal(out_ours, out_sdpa)
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(grads_ours, grads_sdpa, strict=True))


def test_a_frozen_tower_under_grad_mode_is_inference_and_runs_openvino(ov_calls):
    """Grad mode on, but nothing to record (a frozen encoder inside a trained model): OpenVINO runs."""
    model = tiny_model(seed=2, dtype=torch.bfloat16, attn_implementation="openvino").requires_grad_(False)
    pixels, grid_hws = random_pack([(32, 32)], seed=5, dtype=torch.bfloat16)
    model(pixels, grid_hws)
    assert len(ov_calls) == model.config.num_hidden_layers


def test_one_compiled_model_per_thread_count():
    q, k, v = (torch.randn(1, 64, 2, 8).bfloat16() for _ in range(3))

    def on(threads: int) -> torch.Tensor:
        torch.set_num_threads(threads)
        return openvino_sdpa.openvino_sdpa(q, k, v)

    first, second = with_threads(on, 1), with_threads(on, 2)
    assert {1, 2} <= set(openvino_sdpa._compiled)
    torch.testing.assert_close(first, second, rtol=2e-2, atol=2e-2)
    expected = F.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v))).transpose(1, 2)
    torch.testing.assert_close(first.float(), expected, rtol=2e-2, atol=2e-2)


def test_auto_picks_openvino_for_bf16_on_cpu_only():
    assert resolve_attn_implementation("auto", CPU, torch.bfloat16) == "openvino"
    assert resolve_attn_implementation("auto", CPU, torch.float32) == "sdpa"
    assert resolve_attn_implementation("auto", torch.device("cuda"), torch.bfloat16) != "openvino"


def test_auto_on_an_amx_host_takes_sdpa_and_openvino_by_name_still_runs(monkeypatch, ov_calls):
    """AMX: the tower measured 0.80-0.85x as fast with OpenVINO's attention, so ``auto`` keeps torch's
    SDPA there (:func:`~moonvit.model.openvino_sdpa.cpu_attention_choice`); asked for by name,
    OpenVINO's runs (the benchmarks compare the two on such a host)."""
    monkeypatch.setattr(openvino_sdpa, "cpu_host", lambda: dataclasses.replace(zen4_like(), amx=True))
    assert resolve_attn_implementation("auto", CPU, torch.bfloat16) == "sdpa"
    model = tiny_model(seed=2, dtype=torch.bfloat16, attn_implementation="auto")
    pixels, grid_hws = random_pack([(32, 32)], seed=5, dtype=torch.bfloat16)
    with torch.no_grad():
        model(pixels, grid_hws)
        assert ov_calls == []
        model.set_attn_implementation("openvino")
        model(pixels, grid_hws)
    assert len(ov_calls) == model.config.num_hidden_layers


def test_refusals_name_the_reason(monkeypatch):
    with pytest.raises(AttentionUnavailableError, match="used in bf16.*torch.float32"):
        resolve_attn_implementation("openvino", CPU, torch.float32)
    with pytest.raises(AttentionUnavailableError, match="runs on CPU, the model is on cuda"):
        resolve_attn_implementation("openvino", torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ValueError, match="takes bf16 CPU tensors, got torch.float32"):
        openvino_sdpa.openvino_sdpa(*(torch.randn(1, 4, 2, 8) for _ in range(3)))
    monkeypatch.setattr(openvino_sdpa, "cpu_has_bf16_arithmetic", lambda: False)
    assert resolve_attn_implementation("auto", CPU, torch.bfloat16) == "sdpa"
    with pytest.raises(AttentionUnavailableError, match="no bf16 arithmetic"):
        resolve_attn_implementation("openvino", CPU, torch.bfloat16)


def test_not_installed_auto_falls_back_and_the_name_says_how_to_install(monkeypatch):
    backend = attention._BACKENDS["openvino"]
    missing = dataclasses.replace(backend, installed=lambda: "it needs OpenVINO (pip install 'moonvit[openvino]')")
    monkeypatch.setitem(attention._BACKENDS, "openvino", missing)
    assert resolve_attn_implementation("auto", CPU, torch.bfloat16) == "sdpa"
    with pytest.raises(AttentionUnavailableError, match=r"pip install 'moonvit\[openvino\]'"):
        resolve_attn_implementation("openvino", CPU, torch.bfloat16)


FORKED_CHILD = """
import dataclasses, multiprocessing, os, sys, time, torch
sys.path.insert(0, {tests!r})
from helpers import random_pack, tiny_model
from moonvit.model import openvino_sdpa
from moonvit.model.attention import AttentionUnavailableError, resolve_attn_implementation

# as the fixture does in the tests' process
openvino_sdpa.cpu_has_bf16_arithmetic = lambda: True
real_host = openvino_sdpa.cpu_host
openvino_sdpa.cpu_host = lambda: dataclasses.replace(real_host(), amx=False, avx512_bf16=True)
q = torch.randn(1, 64, 2, 8).bfloat16()


def child():
    torch.set_num_threads(1)  # torch's own OpenMP threads do not survive a fork either
    assert resolve_attn_implementation("auto", torch.device("cpu"), torch.bfloat16) == "sdpa"
    try:
        resolve_attn_implementation("openvino", torch.device("cpu"), torch.bfloat16)
        raise AssertionError("openvino was not refused in the forked child")
    except AttentionUnavailableError as error:
        assert "forked" in str(error) and "spawn" in str(error), error
    try:
        openvino_sdpa.openvino_sdpa(q, q, q)
        raise AssertionError("openvino_sdpa ran in the forked child")
    except RuntimeError as error:
        assert "forked" in str(error), error
    pixels, grids = random_pack([(32, 32), (4, 6)], dtype=torch.bfloat16)
    with torch.no_grad():
        auto = tiny_model(dtype=torch.bfloat16, attn_implementation="auto")(pixels, grids).last_hidden_state
        sdpa = tiny_model(dtype=torch.bfloat16, attn_implementation="sdpa")(pixels, grids).last_hidden_state
    assert torch.equal(auto, sdpa)  # auto took sdpa: the same call on the same pack


openvino_sdpa.openvino_sdpa(q, q, q)  # OpenVINO's threads start here, in the parent
process = multiprocessing.get_context("fork").Process(target=child)
process.start()
process.join(240)
if process.is_alive():
    process.kill()
    sys.exit("the forked child hung")
if process.exitcode:
    sys.exit(process.exitcode)
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a plain child's normal exit: interpreter shutdown frees what it holds
for _ in range(120):
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        sys.exit(os.waitstatus_to_exitcode(status))
    time.sleep(1)
os.kill(pid, 9)
sys.exit("the forked child hung at its exit")
"""


@pytest.mark.skipif(sys.platform != "linux", reason="fork, as Linux's multiprocessing defaults to")
def test_a_child_forked_after_openvino_started_takes_sdpa_instead_of_hanging():
    """OpenVINO waits forever in a process forked after it compiled: such a child falls back to sdpa
    under auto, refuses openvino by name, and exits; in a subprocess with a hang guard."""
    script = textwrap.dedent(FORKED_CHILD).format(tests=str(Path(__file__).parent))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
