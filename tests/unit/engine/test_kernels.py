"""pdserve's float32 kernels (linear_f32.c, decode_attention_f32.c): exact to float32 rounding, every row's bits
independent of its batch and of the thread count, and chosen only where they were measured to win, with a reason
either way."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine import kernels
from pdserve.engine.kernels import (
    NATIVE,
    TORCH,
    KernelBuildError,
    KernelChoice,
    NativeKernels,
    build_library,
    choose_kernels,
)

# (out, in): SmolLM2's and qwen3-tiny's linears, plus outputs that leave a part panel and odd widths.
SHAPES = [(960, 576), (576, 1536), (3072, 576), (128, 64), (1000, 576), (17, 33), (5, 3)]
ROWS = 100

pytestmark = pytest.mark.skipif(not {"avx2", "fma"} <= kernels.cpu_flags(), reason="the kernels need AVX2 and FMA")


@pytest.fixture(scope="module")
def kernel() -> NativeKernels:
    return kernels.load_native_kernels()


def case(shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(shape[0] * 7919 + shape[1])
    return torch.randn(shape, generator=gen), torch.randn(ROWS, shape[1], generator=gen)


@pytest.mark.parametrize("shape", SHAPES)
def test_every_row_count_is_within_float32_rounding_of_exact(kernel: NativeKernels, shape: tuple[int, int]) -> None:
    """Bound: K products accumulated in float32 err by at most ~K * 2**-24 * sum|x*w| (doubled for slack)."""
    weight, x = case(shape)
    packed = kernel.pack(weight)
    for m in (1, 2, 5, 6, 7, 12, 13, 47, 48, 49, ROWS):
        out = kernel.linear(x[:m], packed, shape[0])
        assert out.shape == (m, shape[0])
        exact = x[:m].double() @ weight.double().T
        bound = shape[1] * 2**-23 * (x[:m].double().abs() @ weight.double().abs().T)
        assert bool(((out.double() - exact).abs() <= bound).all()), f"M={m}"


@pytest.mark.parametrize("shape", SHAPES)
@settings(max_examples=10, deadline=None)
@given(batch=st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=70), threads=st.sampled_from([1, 2]))
def test_a_row_gets_the_bits_it_gets_alone_in_any_batch_on_any_threads(
    kernel: NativeKernels, shape: tuple[int, int], batch: list[int], threads: int
) -> None:
    weight, x = case(shape)
    packed = kernel.pack(weight)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([kernel.linear(x[j : j + 1], packed, shape[0]) for j in range(ROWS)])
        torch.set_num_threads(threads)
        out = kernel.linear(x[batch], packed, shape[0])
    finally:
        torch.set_num_threads(before)
    for row, j in enumerate(batch):
        assert torch.equal(out[row], alone[j]), f"row {j} at position {row} of {len(batch)} on {threads} threads"


def test_strided_input_is_read_as_its_values(kernel: NativeKernels) -> None:
    weight, x = case((960, 576))
    view = x.t().contiguous().t()[:9]  # the same values, column-major
    assert torch.equal(kernel.linear(view, kernel.pack(weight), 960), kernel.linear(x[:9], kernel.pack(weight), 960))


def test_a_wrong_input_is_refused_before_the_kernel_reads_it(kernel: NativeKernels) -> None:
    packed = kernel.pack(torch.randn(32, 16))
    for bad in (torch.randn(2, 15), torch.randn(2, 16, dtype=torch.bfloat16), torch.randn(16)):
        with pytest.raises(ValueError, match="linear takes float32"):
            kernel.linear(bad, packed, 32)


@pytest.fixture
def fresh_choice(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """choose_kernels reads the CPU and the environment once per process: forget it around a test."""
    choose_kernels.cache_clear()
    yield monkeypatch
    choose_kernels.cache_clear()


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        ({"avx2", "fma"}, NATIVE),
        ({"avx2", "fma", "avx512f"}, f"{TORCH} (an AVX-512 CPU)"),
        ({"avx2"}, f"{TORCH} (the CPU lacks fma)"),
        (set(), f"{TORCH} (the CPU lacks avx2, fma)"),
    ],
)
def test_the_kernels_are_chosen_for_float32_on_avx2_cpus_without_avx512(fresh_choice, flags, reason) -> None:  # type: ignore[no-untyped-def]
    fresh_choice.setattr(kernels, "cpu_flags", lambda: frozenset(flags))
    choice = choose_kernels(torch.float32)
    assert choice.reason == reason
    assert (choice.kernels is not None) == (reason == NATIVE)
    assert choose_kernels(torch.bfloat16).kernels is None


def test_the_operator_can_opt_out(fresh_choice) -> None:  # type: ignore[no-untyped-def]
    fresh_choice.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    fresh_choice.setenv("PDSERVE_NATIVE_KERNELS", "0")
    assert choose_kernels(torch.float32) == KernelChoice(None, f"{TORCH} (PDSERVE_NATIVE_KERNELS=0)")


def test_a_failed_build_names_the_compiler_and_leaves_no_library(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CC", "false")
    with pytest.raises(KernelBuildError, match="false failed on the kernels' sources"):
        build_library(tmp_path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.raises(KernelBuildError, match="no C compiler"):
        build_library(tmp_path)


def test_a_missing_compiler_falls_back_to_onednn_with_the_reason(fresh_choice, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fresh_choice.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    fresh_choice.setattr(kernels, "load_native_kernels", lambda: build_library(tmp_path))
    fresh_choice.setenv("CC", "no-such-compiler-here")
    choice = choose_kernels(torch.float32)
    assert choice.kernels is None
    assert choice.reason == f"{TORCH} ({NATIVE} unavailable: no C compiler ('no-such-compiler-here' is not on PATH))"


def test_the_library_is_built_once_per_source_version(tmp_path: Path) -> None:
    first = build_library(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert build_library(tmp_path) == first and first.stat().st_mtime_ns == stamp
    symbols = subprocess.run(["nm", "-D", str(first)], capture_output=True, text=True).stdout
    assert "pdserve_linear_f32" in symbols and "pdserve_decode_attention_f32" in symbols


# Decode attention: SmolLM2's heads (9 query heads over 3 KV heads of 64) and qwen3-tiny-like ones (4 over 2 of 32).
HEADS = [(9, 3, 64), (4, 2, 32), (2, 2, 128)]
MAX_LEN = 640


def attention_case(num_heads: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cache of 6 slots and 12 rows of fused heads (queries, then keys and values, as the model projects them)."""
    gen = torch.Generator().manual_seed(num_heads * 131 + head_dim)
    cache = torch.randn(2, 6, kv_heads, MAX_LEN, head_dim, generator=gen)
    heads = torch.randn(12, num_heads + 2 * kv_heads, head_dim, generator=gen)
    return cache[0], cache[1], heads


def exact_attention(heads: torch.Tensor, num_heads: int, keys: torch.Tensor, values: torch.Tensor,
                    slots: list[int], lengths: list[int]) -> torch.Tensor:
    """float64, one row at a time: softmax(q k^T / sqrt(d)) v over the row's positions."""
    group = num_heads // keys.shape[1]
    rows = []
    for row, (slot, length) in enumerate(zip(slots, lengths, strict=True)):
        q = heads[row, :num_heads].double()
        k = keys[slot, :, :length].double().repeat_interleave(group, 0)
        v = values[slot, :, :length].double().repeat_interleave(group, 0)
        weights = torch.softmax((q[:, None] @ k.transpose(1, 2))[:, 0] / heads.shape[2] ** 0.5, -1)
        rows.append((weights[:, None] @ v)[:, 0].reshape(-1))
    return torch.stack(rows)


@pytest.mark.parametrize("shape", HEADS)
def test_decode_attention_is_within_float32_rounding_of_exact(kernel: NativeKernels, shape: tuple[int, int, int]) -> None:
    keys, values, heads = attention_case(*shape)
    slots, lengths = [5, 0, 3, 3, 1, 2, 4, 0, 1, 2, 5, 4], [1, 2, 7, 8, 9, 15, 16, 17, 100, 513, 639, MAX_LEN]
    rows = kernel.decode_rows(torch.tensor(slots), torch.tensor(lengths), 6, MAX_LEN)
    out = kernel.decode_attention(heads, shape[0], keys, values, rows)
    exact = exact_attention(heads, shape[0], keys, values, slots, lengths)
    assert out.shape == (12, shape[0] * shape[2])
    # An average of values of magnitude ~1 with weights each within a few float32 ulps: 1e-5 absolute is
    # ~100 ulps of slack, and a wrong key, length or head group is off by ~0.1 or more.
    assert float((out.double() - exact).abs().max()) < 1e-5


@settings(max_examples=15, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 5), st.integers(1, MAX_LEN)), min_size=1, max_size=12),
    threads=st.sampled_from([1, 2]),
    shape=st.sampled_from(HEADS),
)
def test_decode_attention_gives_a_row_its_bits_alone_in_any_batch_on_any_threads(
    kernel: NativeKernels, rows: list[tuple[int, int]], threads: int, shape: tuple[int, int, int]
) -> None:
    keys, values, heads = attention_case(*shape)
    slots, lengths = torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])
    batch = heads[: len(rows)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [kernel.decode_attention(batch[i : i + 1], shape[0], keys, values,
                                         kernel.decode_rows(slots[i : i + 1], lengths[i : i + 1], 6, MAX_LEN))
                 for i in range(len(rows))]
        torch.set_num_threads(threads)
        together = kernel.decode_attention(batch, shape[0], keys, values, kernel.decode_rows(slots, lengths, 6, MAX_LEN))
    finally:
        torch.set_num_threads(before)
    for i, row in enumerate(alone):
        assert torch.equal(together[i], row[0]), f"row {i} of {len(rows)} on {threads} threads"


@settings(max_examples=15, deadline=None)
@given(
    start=st.integers(0, MAX_LEN - 40),
    size=st.integers(1, 40),
    decode_slots=st.lists(st.integers(0, 5), max_size=4),
    threads=st.sampled_from([1, 2]),
    shape=st.sampled_from(HEADS),
)
def test_a_prompt_chunks_rows_in_one_slot_get_their_bits_alone_and_exact_attention(
    kernel: NativeKernels, start: int, size: int, decode_slots: list[int], threads: int, shape: tuple[int, int, int]
) -> None:
    """A chunk's rows (one slot, each up to its own position) are computed in groups that share the keys' reads
    (attend_group); each still gets the bits it gets alone, beside decode rows of other slots."""
    keys, values, heads = attention_case(*shape)
    heads = torch.cat([heads] * 4)  # up to 44 rows
    slots = torch.tensor([*decode_slots, *[3] * size])
    lengths = torch.tensor([*(MAX_LEN - 7 * i for i in range(len(decode_slots))), *range(start + 1, start + size + 1)])
    batch = heads[: len(slots)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [kernel.decode_attention(batch[i : i + 1], shape[0], keys, values,
                                         kernel.decode_rows(slots[i : i + 1], lengths[i : i + 1], 6, MAX_LEN))[0]
                 for i in range(len(slots))]
        torch.set_num_threads(threads)
        together = kernel.decode_attention(batch, shape[0], keys, values, kernel.decode_rows(slots, lengths, 6, MAX_LEN))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(together, torch.stack(alone))
    exact = exact_attention(batch, shape[0], keys, values, slots.tolist(), lengths.tolist())
    assert float((together.double() - exact).abs().max()) < 1e-5


def test_decode_attention_refuses_what_it_cannot_read(kernel: NativeKernels) -> None:
    keys, values, heads = attention_case(9, 3, 64)
    one = torch.tensor([1])
    row = kernel.decode_rows(one, one, 6, MAX_LEN)
    with pytest.raises(ValueError, match="cannot read"):
        kernel.decode_attention(heads[:1].bfloat16(), 9, keys, values, row)
    with pytest.raises(ValueError, match="cannot read"):
        kernel.decode_attention(heads[:1], 8, keys, values, row)  # 8 query heads do not share 3 KV heads
    with pytest.raises(ValueError, match="cannot read"):
        kernel.decode_attention(heads[:1], 9, keys, values, kernel.decode_rows(one, one, 6, MAX_LEN - 1))
    for slot, length in ((6, 1), (-1, 1), (0, 0), (0, MAX_LEN + 1)):
        with pytest.raises(ValueError, match="outside the cache"):
            kernel.decode_rows(torch.tensor([slot]), torch.tensor([length]), 6, MAX_LEN)
