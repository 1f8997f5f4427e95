"""The native ops on fp8 KV caches (kv_cache_dtype "fp8_e4m3" / "fp8_e5m2"): rows written as
`x.float().clamp(-M, M).to(fp8)` stores them, bit for bit; attention over an fp8 cache the
same bits as over that cache widened to the query's dtype (the kernels read each item's rows
widened), for decode and prefill (also in chunks). The fused decode step on fp8 caches:
test_cpu_ops.py's test_decoder_layer_decode_is_the_separate_ops."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.ops import cpu_ops

ops = cpu_ops()
pytestmark = pytest.mark.skipif(
    ops is None or not ops.cpu_has_avx2_fma(), reason="no native AVX2 kernels here"
)
BF16 = torch.bfloat16
FP8 = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@pytest.fixture(autouse=True, params=[True, False], ids=["vbmi", "no-vbmi"])
def vbmi(request):
    """bf16 rows widened by VBMI byte lookups (where the CPU has them) and without: the same
    bits either way."""
    default = ops.cpu_fp8_vbmi(None)
    ops.cpu_fp8_vbmi(request.param)
    yield request.param
    ops.cpu_fp8_vbmi(default)


def quantized(x: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """What an fp8 cache holds for x: saturated, rounded to nearest even by torch's cast."""
    m = FP8[fp8]
    return x.float().clamp(-m, m).to(fp8)


def awkward_values(n: int, g: torch.Generator) -> torch.Tensor:
    """Values over the formats' whole range: normal, subnormal, zero, halfway cases between
    neighbours, beyond the largest finite value, both signs."""
    parts = [
        torch.randn(n, generator=g),
        torch.randn(n, generator=g) * 1e-3,
        torch.randn(n, generator=g) * 1e-6,
        torch.randn(n, generator=g) * 300,
        torch.randn(n, generator=g) * 1e5,
        torch.tensor([0.0, -0.0, 448.0, 464.0, 480.0, -1e9, 57344.0, 61440.0, 2**-9, 2**-10,
                      3 * 2**-11, 2**-16, 2**-17, 3 * 2**-18, 1.0625, 1.1875, 1.125 + 2**-4]),
    ]  # fmt: skip
    return torch.cat(parts)


@pytest.mark.parametrize("fp8", list(FP8), ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_reshape_and_cache_stores_the_saturated_cast(fp8, dtype):
    g = torch.Generator().manual_seed(1)
    hkv, d = 2, 64
    vals = awkward_values(400, g)
    t = -(-vals.numel() // (2 * hkv * d)) + 1
    flat = torch.zeros(t * 2 * hkv * d)
    flat[: vals.numel()] = vals[torch.randperm(vals.numel(), generator=g)]
    kv_rows = flat.view(t, 2, hkv, d).to(dtype)
    key, value = kv_rows[:, 0], kv_rows[:, 1]  # strided rows, as in a fused QKV output
    cache = torch.zeros(2, 4, 16, hkv, d, dtype=fp8)
    slots = torch.randperm(64, generator=g)[:t]
    ops.reshape_and_cache(key, value, cache, slots)
    view = cache.view(torch.uint8).view(2, -1, hkv, d)
    assert torch.equal(view[0, slots], quantized(key, fp8).view(torch.uint8))
    assert torch.equal(view[1, slots], quantized(value, fp8).view(torch.uint8))
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert (view[:, untouched] == 0).all()


def _paged(g, num_blocks, block_size, kv_heads, d, lens, fp8):
    kv = quantized(torch.randn(2, num_blocks, block_size, kv_heads, d, generator=g) * 2, fp8)
    max_blocks = max(-(-n // block_size) for n in lens) + 1
    table = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in lens]).int()
    return kv, table, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize(
    "heads,kv_heads,d,block_size,lens",
    [
        (9, 3, 64, 16, [129, 2, 1]),  # SmolLM2's heads
        (16, 8, 128, 16, [77, 300]),  # Qwen3-0.6B's
        (8, 1, 80, 16, [5, 64]),  # the AVX2 kernel
        (6, 2, 48, 16, [40, 3]),  # the portable one
        (2, 1, 256, 8, [45]),
        (4, 2, 32, 16, [33, 17]),  # the AVX512-BF16 kernel's other head sizes
        (6, 2, 96, 16, [50, 9]),
    ],
)
@pytest.mark.parametrize("fp8", list(FP8), ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_decode_attention_over_fp8_is_over_the_widened_cache(
    heads, kv_heads, d, block_size, lens, fp8, dtype
):
    g = torch.Generator().manual_seed(sum(lens) + d)
    kv, table, seq_lens = _paged(g, 48, block_size, kv_heads, d, lens, fp8)
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    out = ops.paged_decode_attention(q, kv, table, seq_lens, max(lens), d**-0.5)
    ref = ops.paged_decode_attention(q, kv.to(dtype), table, seq_lens, max(lens), d**-0.5)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("d", [64, 96])
@pytest.mark.parametrize("fp8", list(FP8), ids=["e4m3", "e5m2"])
def test_decode_attention_reads_every_fp8_code(d, fp8):
    """A cache of random bytes over every finite code of the format (subnormals, zeros, the
    largest values, both signs): decode attention gives the bits it gives over the cache
    widened by torch."""
    g = torch.Generator().manual_seed(d)
    codes = torch.arange(256, dtype=torch.uint8)
    finite = torch.isfinite(codes.view(fp8).float())
    kv = codes[finite][torch.randint(int(finite.sum()), (2, 24, 16, 2, d), generator=g)]
    kv = kv.view(fp8)
    table = torch.randperm(24, generator=g)[:20].view(2, 10).int()
    seq_lens = torch.tensor([150, 77], dtype=torch.int32)
    q = (torch.randn(2, 6, d, generator=g) * 0.05).to(BF16)  # scores of a few units at most
    out = ops.paged_decode_attention(q, kv, table, seq_lens, 150, d**-0.5)
    ref = ops.paged_decode_attention(q, kv.to(BF16), table, seq_lens, 150, d**-0.5)
    assert torch.isfinite(out.float()).all()
    assert torch.equal(out, ref)


@pytest.mark.parametrize(
    "heads,kv_heads,d,block_size,spans",
    [
        (9, 3, 64, 16, [(0, 147), (0, 1), (100, 40), (31, 9)]),
        (16, 8, 128, 16, [(0, 90), (200, 37)]),
        (8, 1, 80, 16, [(0, 64), (3, 5)]),
    ],
)
@pytest.mark.parametrize("fp8", list(FP8), ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_prefill_attention_over_fp8_is_over_the_widened_cache(
    heads, kv_heads, d, block_size, spans, fp8, dtype
):
    """Whole, and the last request in two calls (its context grows by the first part): the
    same bits as over the widened cache."""
    g = torch.Generator().manual_seed(sum(c + n for c, n in spans) + d)
    lens = [c + n for c, n in spans]
    kv, table, seq_lens = _paged(g, 96, block_size, kv_heads, d, lens, fp8)
    qsl = torch.tensor([0] + list(np.cumsum([n for _, n in spans])), dtype=torch.int64)
    q = torch.randn(int(qsl[-1]), heads, d, generator=g).to(dtype)
    reqs = torch.arange(len(spans))
    out, ref = torch.empty_like(q), torch.empty_like(q)
    ops.paged_prefill_attention(q, out, kv, table, seq_lens, qsl, reqs, d**-0.5)
    ops.paged_prefill_attention(q, ref, kv.to(dtype), table, seq_lens, qsl, reqs, d**-0.5)
    assert torch.equal(out, ref)
    r = len(spans) - 1
    ctx, n = spans[r]
    rows = slice(int(qsl[r]), int(qsl[r + 1]))
    cut = n // 2
    for c0, c1 in ((0, cut), (cut, n)):
        part = torch.empty(c1 - c0, heads, d, dtype=dtype)
        ops.paged_prefill_attention(
            q[rows][c0:c1].contiguous(), part, kv, table[r : r + 1],
            torch.tensor([ctx + c1], dtype=torch.int32), torch.tensor([0, c1 - c0]),
            torch.tensor([0]), d**-0.5,
        )  # fmt: skip
        assert torch.equal(part, out[rows][c0:c1])


# ---- scales (calculate_kv_scales) --------------------------------------------------------

SCALES = (0.0371, 2.6)  # k_scale, v_scale: one below 1, one above


def _inv(scale: float) -> float:
    """1 / scale rounded to fp32 once, as the kernels take it."""
    return float(np.float32(1.0) / np.float32(scale))


def _read(cache: torch.Tensor, dtype: torch.dtype, k_scale: float, v_scale: float) -> torch.Tensor:
    """An fp8 cache read back in `dtype`: fp8 value times its plane's scale in fp32."""
    return torch.stack(
        [(cache[0].float() * k_scale).to(dtype), (cache[1].float() * v_scale).to(dtype)]
    )


@pytest.mark.parametrize("fp8", list(FP8), ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_reshape_and_cache_stores_values_times_the_inverse_scale(fp8, dtype):
    g = torch.Generator().manual_seed(7)
    hkv, d, t = 2, 64, 20
    vals = awkward_values(500, g)
    key = vals[torch.randint(vals.numel(), (t, hkv, d), generator=g)].to(dtype)
    value = (torch.randn(t, hkv, d, generator=g) * 40).to(dtype)
    cache = torch.zeros(2, 4, 16, hkv, d, dtype=fp8)
    slots = torch.randperm(64, generator=g)[:t]
    ops.reshape_and_cache(key, value, cache, slots, *SCALES)
    view = cache.view(torch.uint8).view(2, -1, hkv, d)
    for plane, x, s in ((0, key, SCALES[0]), (1, value, SCALES[1])):
        m = FP8[fp8]
        want = (x.float() * _inv(s)).clamp(-m, m).to(fp8).view(torch.uint8)
        assert torch.equal(view[plane, slots], want)


@pytest.mark.parametrize(
    "heads,kv_heads,d,lens",
    [(9, 3, 64, [129, 2, 1]), (16, 8, 128, [77, 300]), (8, 1, 80, [5, 64]), (6, 2, 48, [40, 3])],
)
@pytest.mark.parametrize("fp8", list(FP8), ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_decode_attention_reads_values_times_the_scale(heads, kv_heads, d, lens, fp8, dtype):
    """With scales, over an fp8 cache: the bits of attention over the cache read back as
    fp8 value times scale, rounded to the query's dtype (every kernel: AVX512-BF16, AVX2,
    portable)."""
    g = torch.Generator().manual_seed(sum(lens) + d)
    kv, table, seq_lens = _paged(g, 48, 16, kv_heads, d, lens, fp8)
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    out = ops.paged_decode_attention(q, kv, table, seq_lens, max(lens), d**-0.5, *SCALES)
    ref = ops.paged_decode_attention(
        q, _read(kv, dtype, *SCALES), table, seq_lens, max(lens), d**-0.5
    )
    assert torch.equal(out, ref)
    unscaled = ops.paged_decode_attention(q, kv, table, seq_lens, max(lens), d**-0.5)
    assert not torch.equal(out, unscaled)


@pytest.mark.parametrize("fp8", list(FP8), ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_prefill_attention_reads_values_times_the_scale(fp8, dtype):
    heads, kv_heads, d, spans = 9, 3, 64, [(0, 47), (100, 40), (31, 9)]
    g = torch.Generator().manual_seed(5)
    lens = [c + n for c, n in spans]
    kv, table, seq_lens = _paged(g, 96, 16, kv_heads, d, lens, fp8)
    qsl = torch.tensor([0] + list(np.cumsum([n for _, n in spans])), dtype=torch.int64)
    q = torch.randn(int(qsl[-1]), heads, d, generator=g).to(dtype)
    reqs = torch.arange(len(spans))
    out, ref = torch.empty_like(q), torch.empty_like(q)
    ops.paged_prefill_attention(q, out, kv, table, seq_lens, qsl, reqs, d**-0.5, *SCALES)
    widened = _read(kv, dtype, *SCALES)
    ops.paged_prefill_attention(q, ref, widened, table, seq_lens, qsl, reqs, d**-0.5)
    assert torch.equal(out, ref)


def test_scales_are_checked():
    q = torch.randn(1, 2, 64).to(BF16)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    bf16_cache = torch.zeros(2, 2, 16, 1, 64, dtype=BF16)
    with pytest.raises(RuntimeError, match="fp8 KV cache only"):
        ops.paged_decode_attention(q, bf16_cache, table, lens, 3, 0.125, 0.5, 1.0)
    fp8_cache = bf16_cache.to(torch.float8_e4m3fn)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(RuntimeError, match="k_scale / v_scale"):
            ops.paged_decode_attention(q, fp8_cache, table, lens, 3, 0.125, bad, 1.0)
