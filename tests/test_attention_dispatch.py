"""Which backend ``auto`` names, without a GPU: per device, dtype, torch (varlen module present or not,
its old or new signature) and flash-attn presence; and the CPU rule, host facts -> backend, pinned."""

from __future__ import annotations

import dataclasses
import importlib.machinery
import logging
import sys
import types

import pytest
import torch

from moonvit.model import attention, openvino_sdpa, varlen
from moonvit.model.attention import AttentionUnavailableError, resolve_attn_implementation
from moonvit.model.openvino_sdpa import OPENVINO_MIN_PATCHES, CpuHost, cpu_attention_choice, openvino_declined

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def new_varlen_attn(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
    enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
):  # fmt: skip
    """torch 2.12's signature (2.13 the same): ``window_size`` and ``scale``."""
    raise AssertionError("not called in these tests")


def old_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10's signature: ``is_causal``, no ``scale``."""
    raise AssertionError("not called in these tests")


def odd_varlen_attn(query, key, value, offsets, lengths):
    """A signature this package does not know."""
    raise AssertionError("not called in these tests")


SIGNATURES = {"new": new_varlen_attn, "old": old_varlen_attn, "unknown": odd_varlen_attn}


@pytest.fixture
def host(monkeypatch):
    """``host(flash=..., torch_varlen=..., capability=..., cpu=..., openvino=...)``: the facts the
    dispatch reads, set for one test. ``torch_varlen``: ``new``, ``old``, ``unknown`` (a signature
    not known here) or ``absent`` (a torch before 2.10)."""
    real_find_spec = varlen.importlib.util.find_spec

    def set_host(
        *,
        flash: bool = False,
        torch_varlen: str = "new",
        capability: tuple[int, int] | None = None,
        cpu: CpuHost | None = None,
        openvino: bool = True,
    ) -> None:
        monkeypatch.setattr(varlen, "_found", {})
        monkeypatch.setattr(attention, "flash_attn_installed", lambda: flash)
        if torch_varlen == "absent":

            def find_spec(name, *args):
                return None if name == "torch.nn.attention.varlen" else real_find_spec(name, *args)

            monkeypatch.setattr(varlen.importlib.util, "find_spec", find_spec)
        else:
            module = types.ModuleType("torch.nn.attention.varlen")
            module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
            module.varlen_attn = SIGNATURES[torch_varlen]  # type: ignore[attr-defined]
            monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", module)
        monkeypatch.setattr(varlen, "_capability", lambda device: capability)
        monkeypatch.setattr(openvino_sdpa, "cpu_host", lambda: cpu or ZEN4)
        monkeypatch.setattr(openvino_sdpa, "cpu_has_bf16_arithmetic", lambda: True)
        backend = attention._BACKENDS["openvino"]
        installed = (lambda: None) if openvino else (lambda: "it needs OpenVINO, which is not installed")
        monkeypatch.setitem(attention._BACKENDS, "openvino", dataclasses.replace(backend, installed=installed))

    monkeypatch.setattr(varlen, "_found", {})
    monkeypatch.setattr(attention, "_logged_fallbacks", set())
    return set_host


# The host classes measured (benchmarks/results/cpu_attention_choice.md), and one not measured.
ZEN4 = CpuHost(amx=False, avx512_bf16=True, threads=2, torch_version="2.13.0", openvino=True)
AMX = CpuHost(amx=True, avx512_bf16=True, threads=2, torch_version="2.13.0", openvino=True)
AVX2 = CpuHost(amx=False, avx512_bf16=False, threads=2, torch_version="2.13.0", openvino=True)


# ---- CUDA: flash-attn, then varlen, then sdpa -----------------------------------------------------


@pytest.mark.parametrize(
    "flash, torch_varlen, capability, dtype, expected",
    [
        (True, "new", (9, 0), BF16, "flash_attention_2"),
        (True, "absent", None, FP16, "flash_attention_2"),
        (False, "new", (9, 0), BF16, "varlen"),
        (False, "new", None, FP16, "varlen"),
        (False, "old", (8, 0), BF16, "varlen"),
        (False, "absent", None, BF16, "sdpa"),
        (False, "unknown", None, BF16, "sdpa"),
        (False, "new", (7, 5), BF16, "sdpa"),
        (False, "new", (9, 0), FP32, "sdpa"),
        (True, "new", (9, 0), FP32, "sdpa"),
    ],
)
def test_auto_on_cuda(host, flash, torch_varlen, capability, dtype, expected):
    host(flash=flash, torch_varlen=torch_varlen, capability=capability)
    assert resolve_attn_implementation("auto", CUDA, dtype) == expected
    assert resolve_attn_implementation("auto", torch.device("cuda", 1), dtype) == expected


@pytest.mark.parametrize("cpu", [ZEN4, AMX, AVX2], ids=["zen4", "amx", "avx2"])
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
def test_auto_never_names_a_gpu_backend_on_cpu(host, cpu, dtype):
    host(flash=True, torch_varlen="new", capability=(9, 0), cpu=cpu)
    assert resolve_attn_implementation("auto", CPU, dtype) == cpu_attention_choice(cpu, dtype, OPENVINO_MIN_PATCHES)


@pytest.mark.parametrize(
    "device, dtype, torch_varlen, capability, message",
    [
        (CPU, BF16, "new", None, "runs on CUDA, the model is on cpu"),
        (CUDA, FP32, "new", None, r"runs in bf16 or fp16, the model is torch.float32"),
        (CUDA, BF16, "absent", None, r"torch.nn.attention.varlen \(torch >= 2.10\)"),
        (CUDA, BF16, "unknown", None, r"takes \(.*offsets.*\), not the packed call"),
        (CUDA, BF16, "new", (7, 5), "needs an SM80 or newer GPU.*sm_75"),
    ],
)
def test_varlen_by_name_where_it_cannot_run_says_why(host, device, dtype, torch_varlen, capability, message):
    host(torch_varlen=torch_varlen, capability=capability)
    with pytest.raises(AttentionUnavailableError, match=f"attn_implementation='varlen' cannot run: .*{message}"):
        resolve_attn_implementation("varlen", device, dtype)


def test_a_torch_without_varlen_refuses_the_name_at_once(host):
    """The name is refused where configs and command lines are checked, before any model is built."""
    host(torch_varlen="absent")
    with pytest.raises(AttentionUnavailableError, match=r"torch >= 2.10\), this is torch"):
        attention.check_attn_implementation("varlen")


def test_the_signature_decides_the_keywords(host):
    host(torch_varlen="old")
    kernel = varlen.varlen_kernel()
    assert not isinstance(kernel, str) and kernel[0] is old_varlen_attn
    assert varlen.varlen_keywords(kernel[1], 72) == {"is_causal": False}  # the kernel's default scale
    host(torch_varlen="new")
    kernel = varlen.varlen_kernel()
    assert not isinstance(kernel, str) and kernel[0] is new_varlen_attn
    assert varlen.varlen_keywords(kernel[1], 64) == {"window_size": (-1, -1), "scale": 0.125}


def test_the_installed_torch_is_read_as_it_is(monkeypatch):
    """This torch (whatever its version): the module is there or not, and a present one has a known form."""
    monkeypatch.setattr(varlen, "_found", {})
    has_module = varlen.importlib.util.find_spec("torch.nn.attention.varlen") is not None
    assert (varlen.varlen_not_installed() is None) == has_module
    if has_module:
        kernel = varlen.varlen_kernel()
        assert not isinstance(kernel, str), kernel
        assert {"window_size", "is_causal"} & kernel[1]


def test_auto_on_cuda_says_once_which_it_took(host, caplog):
    """varlen taken for want of flash-attn: a note; sdpa on CUDA (the slow path there): a warning."""
    host(torch_varlen="new", capability=(9, 0))
    with caplog.at_level(logging.INFO, logger="moonvit"):
        for _ in range(3):
            resolve_attn_implementation("auto", CUDA, BF16)
            resolve_attn_implementation("auto", CUDA, FP32)
    records = [r for r in caplog.records if r.name == "moonvit"]
    assert [r.levelno for r in records] == [logging.INFO, logging.WARNING], [r.getMessage() for r in records]
    assert "flash-attn" in records[0].getMessage() and records[0].getMessage().endswith("using varlen")
    assert "varlen: torch's varlen_attn runs in bf16 or fp16" in records[1].getMessage()
    assert records[1].getMessage().endswith("using sdpa")


# ---- CPU: the rule, host facts -> backend ------------------------------------------------------------


@pytest.mark.parametrize(
    "cpu, dtype, seqlen, expected",
    [
        # AMD Zen 4 (AVX512-BF16, no AMX): OpenVINO's attention for bf16 items of 1,024 patches or more
        (ZEN4, BF16, 1024, "openvino"),
        (ZEN4, BF16, 16384, "openvino"),
        (ZEN4, BF16, 1023, "sdpa"),
        (ZEN4, BF16, 256, "sdpa"),
        (ZEN4, FP32, 4096, "sdpa"),
        (ZEN4, FP16, 4096, "sdpa"),
        (dataclasses.replace(ZEN4, openvino=False), BF16, 4096, "sdpa"),
        # Intel with AMX: torch's SDPA at every length (OpenVINO measured 0.80-0.85x)
        (AMX, BF16, 1024, "sdpa"),
        (AMX, BF16, 4096, "sdpa"),
        (AMX, BF16, 25600, "sdpa"),
        (dataclasses.replace(AMX, avx512_bf16=False), BF16, 4096, "sdpa"),
        # no bf16 arithmetic, or not x86: unmeasured, torch's
        (AVX2, BF16, 4096, "sdpa"),
    ],
)
def test_the_cpu_rule(cpu, dtype, seqlen, expected):
    assert cpu_attention_choice(cpu, dtype, seqlen) == expected
    reason = openvino_declined(cpu, dtype, seqlen)
    assert (reason is None) == (expected == "openvino")


def test_the_reasons_name_the_fact(host):
    assert "AMX" in openvino_declined(AMX, BF16)
    assert "AVX512-BF16" in openvino_declined(AVX2, BF16)
    assert "1024 patches" in openvino_declined(ZEN4, BF16, 100)
    assert "not installed" in openvino_declined(dataclasses.replace(ZEN4, openvino=False), BF16)


def test_auto_follows_the_rule_and_a_name_still_runs(host, caplog):
    """On an AMX host auto takes sdpa and says why; ``openvino`` asked for by name runs there all the same."""
    host(cpu=AMX)
    with caplog.at_level(logging.INFO, logger="moonvit"):
        assert resolve_attn_implementation("auto", CPU, BF16) == "sdpa"
    assert any("openvino: this CPU has AMX" in r.getMessage() for r in caplog.records)
    assert resolve_attn_implementation("openvino", CPU, BF16) == "openvino"
    host(cpu=ZEN4)
    assert resolve_attn_implementation("auto", CPU, BF16) == "openvino"
    host(cpu=ZEN4, openvino=False)
    assert resolve_attn_implementation("auto", CPU, BF16) == "sdpa"


def test_the_host_facts_are_this_process():
    facts = openvino_sdpa.cpu_host()
    assert facts.threads == torch.get_num_threads() and facts.torch_version == torch.__version__
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    assert facts.amx == (amx is not None and bool(amx()))
    assert facts.openvino == (openvino_sdpa.openvino_not_installed() is None)


def test_under_a_tracer_auto_asks_no_host_question(monkeypatch):
    """A tracer cannot follow the host queries, and an inference-only backend runs sdpa there anyway."""

    def asked() -> CpuHost:
        raise AssertionError("the host was asked under a tracer")

    monkeypatch.setattr(openvino_sdpa, "cpu_host", asked)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert resolve_attn_implementation("auto", CPU, BF16) == "sdpa"
    assert resolve_attn_implementation("openvino", CPU, BF16) == "openvino"  # attention_for_call: sdpa
