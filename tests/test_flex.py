"""The ``flex`` backend: its block mask against the element mask it stands for, its output against
eager attention on packs whose items straddle the 128-row tiles, and what it refuses."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from helpers import FLEX, random_pack, tiny_model

from moonvit.model import flex
from moonvit.model.attention import AttentionUnavailableError, resolve_attn_implementation

SEQLENS = [
    (5,),
    (128,),
    (256, 256, 256),
    (5, 300, 128, 1, 200),
    (127, 2, 129, 640),
]


def element_mask(seqlens: tuple[int, ...]) -> torch.Tensor:
    """(L', L') bool: rows of one item (padding rows are one more item) see each other."""
    total = sum(seqlens)
    lengths = [*seqlens, flex.padded_length(total) - total]
    item = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return item[:, None] == item[None, :]


@pytest.mark.parametrize("seqlens", SEQLENS, ids=str)
def test_the_block_mask_keeps_exactly_the_tiles_that_hold_pairs_of_one_item(seqlens):
    dense = element_mask(seqlens)
    mask = flex.document_block_mask(seqlens, torch.device("cpu"))
    tiles = dense.unflatten(0, (-1, flex.BLOCK)).unflatten(2, (-1, flex.BLOCK))  # (Q, 128, KV, 128)
    any_pair, all_pairs = tiles.any(dim=(1, 3)), tiles.all(dim=(1, 3))

    def listed(count: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        kept = torch.zeros_like(any_pair)
        for q_tile, n in enumerate(count[0, 0].tolist()):
            kept[q_tile, index[0, 0, q_tile, :n].long()] = True
        return kept

    partial = listed(mask.kv_num_blocks, mask.kv_indices)
    full = listed(mask.full_kv_num_blocks, mask.full_kv_indices)
    assert torch.equal(full, all_pairs)
    assert torch.equal(partial, any_pair & ~all_pairs)
    # and its mask_mod is the element mask on the tiles it is evaluated on
    q, k = torch.meshgrid(torch.arange(dense.shape[0]), torch.arange(dense.shape[0]), indexing="ij")
    assert torch.equal(mask.mask_mod(0, 0, q, k), dense)


def test_block_masks_are_cached_per_pack():
    first = flex.document_block_mask((3, 200), torch.device("cpu"))
    assert flex.document_block_mask((3, 200), torch.device("cpu")) is first
    assert flex.document_block_mask((200, 3), torch.device("cpu")) is not first


PACKS = ([(2, 4), (10, 14), (8, 16), (2, 2)], [(16, 16)], [(10, 6)] * 5)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("impl", [FLEX])
def test_flex_matches_eager_in_float32_on_packs_that_straddle_tiles(impl):
    """Items cross tile boundaries and share tiles; new pack sizes reuse the one compiled kernel."""
    model = tiny_model(seed=4)
    for grids in PACKS:
        pixels, grid_hws = random_pack(grids, seed=len(grids))
        outputs = {}
        for name in ("eager", impl):
            model.set_attn_implementation(name)
            with torch.no_grad():
                outputs[name] = model(pixels, grid_hws)
        for field in ("last_hidden_state", "merged"):
            ours, eager = getattr(outputs[impl], field), getattr(outputs["eager"], field)
            torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    keys = [key[:4] for key in flex.first_call_seconds()]
    assert ("cpu", torch.float32, model.config.num_attention_heads, head_dim) in keys


@pytest.mark.parametrize("impl", [FLEX])
def test_flex_in_bfloat16_is_as_close_to_float32_as_sdpa(impl):
    """bf16 rounding differs between kernels: flex's error against the float32 answer is within
    25% of sdpa's (plus 1e-3), on the same packs."""
    exact_model, model = tiny_model(seed=4), tiny_model(seed=4, dtype=torch.bfloat16)
    for grids in PACKS:
        pixels, grid_hws = random_pack(grids, seed=len(grids))
        with torch.no_grad():
            exact = exact_model(pixels, grid_hws).last_hidden_state
            errors = {}
            for name in ("sdpa", impl):
                model.set_attn_implementation(name)
                errors[name] = rel(model(pixels.bfloat16(), grid_hws).last_hidden_state, exact)
        assert errors[impl] <= 1.25 * errors["sdpa"] + 1e-3, errors


@pytest.mark.parametrize("impl", [FLEX])
def test_training_with_flex_on_cpu_is_refused_naming_sdpa(impl):
    model = tiny_model(attn_implementation=impl).train()
    pixels, grids = random_pack([(4, 4)])
    with pytest.raises(AttentionUnavailableError, match="no backward on CPU.*'sdpa'"):
        model(pixels, grids)


def test_flex_in_float64_is_refused_naming_the_dtype():
    with pytest.raises(AttentionUnavailableError, match="fp32, bf16 or fp16, the model is torch.float64"):
        resolve_attn_implementation("flex", torch.device("cpu"), torch.float64)


def test_auto_never_picks_flex():
    """flex is opt-in: slower than sdpa on the CPUs measured (see the speed section of benchmarks/README.md)."""
    for dtype in (torch.float32, torch.bfloat16):
        assert resolve_attn_implementation("auto", torch.device("cpu"), dtype) in ("sdpa", "openvino")


def _fake_kernels(monkeypatch, fail: dict[bool, BaseException | None]):
    """Stand-ins for the compiled kernels (no compile): each entry returns its query, and raises
    ``fail[fresh]`` once when that is set; the calls are recorded as ``fresh`` flags."""
    calls: list[bool] = []

    def kernel(key, fresh=False):
        def attend(q, k, v, block_mask):
            calls.append(fresh)
            error = fail.get(fresh)
            if error is not None:
                fail[fresh] = None
                raise error
            return q.clone()

        return attend

    monkeypatch.setattr(flex, "_kernel", kernel)
    monkeypatch.setattr(flex, "_first_calls", {})
    return calls


def _attend_once() -> torch.Tensor:
    q = torch.randn(10, 2, 8, generator=torch.Generator().manual_seed(0))
    return flex.flex_attention(q, q, q, SimpleNamespace(seqlens=(3, 7)))  # the grid's item lengths only


def test_the_first_compile_of_a_kernel_is_announced_before_it_starts(monkeypatch, caplog):
    calls = _fake_kernels(monkeypatch, {})
    with caplog.at_level(logging.INFO, logger="moonvit.flex"):
        _attend_once()
        announced = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiling")]
        assert announced == ["compiling the flex attention kernel for cpu torch.float32, 2 heads x 8 (once per "
                             "shape; it can take tens of seconds)"]  # fmt: skip
        _attend_once()  # the same shape: compiled already, nothing said
        assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiling")] == announced
    assert calls == [False, False]


def test_command_lines_print_the_compile_notice(tmp_path, monkeypatch, capsys):
    from moonvit.__main__ import main

    _fake_kernels(monkeypatch, {})
    monkeypatch.setattr(flex, "flex_unavailable", lambda device, dtype: None)  # no compiler needed
    main(["--preset", "tiny", "--dtype", "fp32", "--attn", "flex", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "compiling the flex attention kernel for cpu torch.float32, 4 heads x 16 (once per shape" in err
    assert len([line for line in err.splitlines() if line.startswith("compiling")]) == 1
    assert not logging.getLogger("moonvit.flex").handlers  # the command line's printer is gone after it


def test_a_failed_recompile_is_retried_once_in_a_fresh_entry(monkeypatch, caplog):
    from torch._dynamo.exc import BackendCompilerFailed

    calls = _fake_kernels(monkeypatch, {})
    first = _attend_once()
    failure = BackendCompilerFailed(lambda *a: None, RuntimeError("cur_qSplitSize was not declared\nmore"), None)
    calls = _fake_kernels(monkeypatch, {False: failure})
    flex._first_calls[("cpu", torch.float32, 2, 8, torch.get_num_threads(), False, False)] = 1.0
    with caplog.at_level(logging.INFO, logger="moonvit.flex"), torch.no_grad():
        torch.testing.assert_close(_attend_once(), first)
    assert calls == [False, True]  # the failing entry, then one fresh entry
    (line,) = [r.getMessage() for r in caplog.records if "recompiling" in r.getMessage()]
    assert "(RuntimeError: cur_qSplitSize was not declared)" in line and "more" not in line  # the cause, one line


def test_other_errors_and_a_failing_fresh_entry_are_raised_not_retried(monkeypatch):
    from torch._dynamo.exc import BackendCompilerFailed

    key = ("cpu", torch.float32, 2, 8, torch.get_num_threads(), False, False)
    calls = _fake_kernels(monkeypatch, {False: ValueError("bad input")})
    flex._first_calls[key] = 1.0
    with pytest.raises(ValueError, match="bad input"), torch.no_grad():
        _attend_once()
    assert calls == [False]  # not a compile error: no second compile
    failure = BackendCompilerFailed(lambda *a: None, RuntimeError("no build"), None)
    calls = _fake_kernels(monkeypatch, {False: failure, True: failure})
    flex._first_calls[key] = 1.0
    with pytest.raises(BackendCompilerFailed), torch.no_grad():
        _attend_once()
    assert calls == [False, True]  # once
    calls = _fake_kernels(monkeypatch, {False: failure})  # the first compile of a key: nothing to retry
    with pytest.raises(BackendCompilerFailed), torch.no_grad():
        _attend_once()
    assert calls == [False]
