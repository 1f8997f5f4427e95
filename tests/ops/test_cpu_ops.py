"""The native CPU operators against their PyTorch references, over many shapes.

Elementwise kernels reproduce the PyTorch code's roundings, in bf16 and in fp32 (equal, or
within one bf16 step / a few fp32 ulps where only float summation order or exp differs); the
GEMM and attention accumulate in fp32 in another order than the references and are held to
fp32-accumulation tolerances.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedllm.config import env_flag
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.cpu_gemm import to_panels
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.quantization import int8_linear, quantize_rows
from pagedllm.layers.rotary_embedding import get_rope
from pagedllm.ops import cpu_ops

ops = cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="native CPU ops not built here")
needs_bf16 = pytest.mark.skipif(
    ops is None or not ops.cpu_has_avx512_bf16(), reason="no AVX512-BF16 on this CPU"
)
needs_avx2 = pytest.mark.skipif(
    ops is None or not ops.cpu_has_avx2_fma(), reason="no AVX2 + FMA on this CPU"
)
BF16 = torch.bfloat16


@pytest.fixture(params=[True, False], ids=["amx-allowed", "amx-off"])
def amx_allowed(request):
    """The kernels with AMX tiles allowed (where the CPU has them) and turned off."""
    default = env_flag("PAGEDLLM_CPU_AMX", True)
    ops.cpu_allow_amx(request.param and default)
    yield request.param
    ops.cpu_allow_amx(default)


@pytest.fixture(
    params=[(True, False), (False, False), (False, True)],
    ids=["row-words", "row-bytes", "row-bytes-stream"],
)
def int8_row_kernel(request):
    """One-row int8 products as int16 words (vpdpwssd) and as two byte rows (vpdpbusd), those
    with and without their non-temporal prefetch: the VNNI kernel's ways, whichever this CPU
    takes by default (the same bits)."""
    words, stream = request.param
    defaults = ops.cpu_int8_row_words(None), ops.cpu_int8_row_stream(None)
    ops.cpu_int8_row_words(words)
    ops.cpu_int8_row_stream(stream)
    yield words
    ops.cpu_int8_row_words(defaults[0])
    ops.cpu_int8_row_stream(defaults[1])


def torch_path(monkeypatch):
    """Make the layers take their PyTorch code (the kernels are looked up per call)."""
    for layer in ("layernorm", "activation", "rotary_embedding"):
        monkeypatch.setattr(f"pagedllm.layers.{layer}.row_ops", lambda x: None)


@needs_avx2
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("n,k", [(1, 1), (64, 64), (100, 770), (130, 65), (1280, 96)])
def test_linear_avx2(n, k, dtype):
    """AVX2 panels of fp32 or bf16 weights (fp32 arithmetic): close to F.linear in fp32 on the
    same values for partial panels and K chunks, bias or none, either output dtype; and each
    row's result bit-identical whatever batch it comes in (one row, 6-row tiles, the 2-5-row
    tiles of a block's last rows, with and without the widened weight chunk, row blocks of
    96)."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(200, k, generator=g).to(dtype)
    panels = to_panels(w, 1)
    assert panels.shape == (-(-n // 64), k, 64, 1) and panels.dtype == dtype
    for b in (None, bias):
        ref = F.linear(x.float(), w.float(), None if b is None else b.float())
        y32 = ops.linear_avx2(x, panels, b, n, True)
        torch.testing.assert_close(y32, ref, rtol=1e-5, atol=1e-4)
        y = ops.linear_avx2(x, panels, b, n, False)
        assert y.dtype == dtype and torch.equal(y, y32.to(dtype))  # one rounding, of the sum
        for m in (1, 2, 3, 4, 5, 6, 7, 14, 15, 16, 17, 97):
            assert torch.equal(ops.linear_avx2(x[m : 2 * m], panels, b, n, False), y[m : 2 * m])
    strided = torch.randn(3, 2 * k, generator=g).to(dtype)[:, :k]
    assert torch.equal(
        ops.linear_avx2(strided, panels, None, n, True),
        ops.linear_avx2(strided.contiguous(), panels, None, n, True),
    )


@needs_bf16
@pytest.mark.parametrize("m", [1, 3, 6, 7, 64, 97, 200])
# 4,160 x 64: 65 panels, so the threads take runs of several items and claim the next run
# ahead (the AMX items prefetch the next item's panel).
@pytest.mark.parametrize("n,k", [(1, 2), (64, 64), (100, 768), (130, 770), (1280, 96), (4160, 64)])
def test_linear_bf16(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(BF16)
    w = (torch.randn(n, k, generator=g) * 0.1).to(BF16)
    bias = torch.randn(n, generator=g).to(BF16)
    ref = F.linear(x.double(), w.double(), bias.double())
    for out_fp32 in (False, True):
        y = ops.linear(x, to_panels(w), bias, n, out_fp32)
        assert y.dtype == (torch.float32 if out_fp32 else BF16) and y.shape == (m, n)
        tol = 1e-4 if out_fp32 else 1e-2
        torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * 4)


@needs_avx2
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 97, 200])
@pytest.mark.parametrize("n,k", [(1, 1), (64, 64), (100, 770), (130, 3001), (1280, 96), (4160, 64)])
def test_linear_int8_equals_the_reference(m, n, k, dtype, int8_row_kernel):
    """The W8A16 kernel (AMX tiles, AVX512-VNNI with a row as int16 words or as byte rows, or
    AVX2: whichever this CPU has) computes `int8_linear`'s numbers exactly (integer sums, the
    same float steps), for bf16 and fp32 activations, K not a multiple of 4 or of the kernels'
    K chunks, partial panels, bias or none, either output dtype, row tiles and leftovers."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    x[0] = x[0].abs()  # a row without negatives (zero point 0), and one of zeros (span 0)
    if m > 1:
        x[-1] = 0
    q, scale = quantize_rows(torch.randn(n, k, generator=g))
    bias = torch.randn(n, generator=g).to(dtype)
    panels = to_panels(q)
    colsum = F.pad(q.sum(dim=1, dtype=torch.int32), (0, panels.shape[0] * 64 - n))
    for out_fp32, b in ((False, bias), (True, None), (True, bias)):
        y = ops.linear_int8(x, panels, scale, colsum, b, n, out_fp32)
        out_dtype = torch.float32 if out_fp32 else dtype
        assert y.dtype == out_dtype
        assert torch.equal(y, int8_linear(x, q, scale, b, out_dtype))


@needs_bf16
@pytest.mark.parametrize("k", [64, 770, 2048])
def test_linear_bf16_rows_do_not_depend_on_their_batch(k):
    """A row's bf16-panel result is the same bits in every batch of two rows or more (on AMX
    CPUs, the tile kernel's; the tile halves of 16 rows, a K tail past a multiple of 32 and
    partial row blocks included: 96 rows, or on AMX 128 at K = 2048), and in a batch of one
    without AMX."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(130, k, generator=g).to(BF16)
    w = (torch.randn(200, k, generator=g) * 0.1).to(BF16)
    panels = to_panels(w)
    full = ops.linear(x, panels, None, 200, True)
    for start, stop in ((0, 2), (5, 21), (17, 50), (33, 130), (96, 99), (120, 130)):
        assert torch.equal(ops.linear(x[start:stop], panels, None, 200, True), full[start:stop])
    if not ops.cpu_has_amx():
        assert torch.equal(ops.linear(x[7:8], panels, None, 200, True), full[7:8])


@pytest.mark.skipif(
    ops is None or not (ops.cpu_has_avx512_bf16() and ops.cpu_has_avx512_vnni()),
    reason="no AVX512-BF16 + VNNI on this CPU",
)
@pytest.mark.parametrize("k", [576, 770])
def test_products_of_many_row_tiles_are_those_of_one_tile(k, amx_allowed):
    """Rows in an item of many 32-row tiles (on AMX each tile's epilogue runs during the next
    tile's products, the sums double-buffered) get the bits that the same rows get as a
    product of one tile alone: plain bf16 products with a bias, either output dtype, gate /
    up with SiLU x mul, and int8 (W8A16, byte rows in pairs); K with and without a tail."""
    g = torch.Generator().manual_seed(k)
    m, n = 600, 960  # 600 rows: a row block of many tiles, then a shorter one
    x = torch.randn(m, k, generator=g).to(BF16)
    w = (torch.randn(2 * n, k, generator=g) * 0.1).to(BF16)
    bias = torch.randn(2 * n, generator=g).to(BF16)
    panels, gate_up = to_panels(w[:n]), to_panels(w)
    q, scale = quantize_rows(w[:n].float())
    qpanels = to_panels(q)
    colsum = F.pad(q.sum(dim=1, dtype=torch.int32), (0, qpanels.shape[0] * 64 - n))
    products = (
        lambda rows: ops.linear(rows, panels, bias[:n], n, False),
        lambda rows: ops.linear(rows, panels, bias[:n], n, True),
        lambda rows: ops.linear_silu_mul(rows, gate_up, bias, 2 * n),
        lambda rows: ops.linear_int8(rows, qpanels, scale, colsum, bias[:n], n, False),
    )
    for product in products:
        full = product(x)
        for start in range(0, m, 32):
            stop = min(m, start + 32)
            assert torch.equal(product(x[start:stop]), full[start:stop])


@needs_bf16
@pytest.mark.parametrize("m", [1, 5, 7, 64, 130])
@pytest.mark.parametrize("n,k", [(100, 96), (960, 576), (4160, 64)])
def test_bf16_products_do_not_depend_on_the_thread_count(m, n, k):
    """Every output of the panel products (plain, and with SiLU x mul) is the same bits on 1,
    2 or 3 threads: however the threads share the items out, each output is one item's whole
    sum, in an order fixed by K alone."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(BF16)
    w = (torch.randn(2 * n, k, generator=g) * 0.1).to(BF16)
    bias = torch.randn(2 * n, generator=g).to(BF16)
    panels, gu = to_panels(w[:n]), to_panels(w[: 2 * (n // 64 * 64)])
    n_gu = 2 * (n // 64 * 64)
    saved = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(
                (
                    ops.linear(x, panels, bias[:n], n, True),
                    ops.linear(x, panels, None, n, False),
                    ops.linear_silu_mul(x, gu, bias[:n_gu], n_gu),
                )
            )
    finally:
        torch.set_num_threads(saved)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
    ref = F.linear(x.double(), w[:n].double(), bias[:n].double())
    torch.testing.assert_close(results[1][0].double(), ref, rtol=1e-4, atol=4e-4)


@needs_bf16
def test_linear_reads_strided_rows():
    x = torch.randn(5, 96).to(BF16)[:, :64]  # rows 96 apart
    w = torch.randn(32, 64).to(BF16)
    y = ops.linear(x, to_panels(w), None, 32, True)
    torch.testing.assert_close(y, F.linear(x.float(), w.float()), rtol=1e-4, atol=1e-4)


@needs_bf16
@pytest.mark.parametrize("m", [1, 2, 17, 33, 97, 600])
@pytest.mark.parametrize("n,k", [(128, 64), (3072, 576), (256, 770)])
def test_linear_silu_mul_is_silu_and_mul_of_linear(m, n, k):
    """The gate / up product with SiLU x mul in its epilogue gives the bits of the two ops
    (one row, AMX tiles' halves and leftovers, a K tail past a multiple of 32, several items
    a thread), with and without a bias, from strided rows too."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k + 8, generator=g).to(BF16)[:, :k]
    panels = to_panels((torch.randn(n, k, generator=g) * 0.1).to(BF16))
    for bias in (None, torch.randn(n, generator=g).to(BF16)):
        ref = ops.silu_and_mul(ops.linear(x, panels, bias, n, False))
        assert torch.equal(ops.linear_silu_mul(x, panels, bias, n), ref)
    with pytest.raises(RuntimeError, match="n = 2 x a multiple of 64, got 96"):
        ops.linear_silu_mul(x, to_panels(torch.randn(96, k).to(BF16)), None, 96)


@pytest.mark.skipif(
    ops is None or not (ops.cpu_has_avx512_bf16() and ops.cpu_has_avx512_vnni()),
    reason="no AVX512-BF16 + VNNI on this CPU",
)
@pytest.mark.parametrize("m", [1, 2, 7, 97])
@pytest.mark.parametrize("n,k", [(128, 64), (3072, 576), (256, 770)])
def test_linear_int8_silu_mul_is_silu_and_mul_of_linear_int8(m, n, k, amx_allowed, int8_row_kernel):
    """int8 gate / up weights with SiLU x mul in the epilogue: the bits of the two ops (one
    row, row tiles and leftovers, K not a multiple of 4, several items a thread), with and
    without a bias, from strided rows too; a batch that the AMX tiles take is not fused."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = (torch.randn(m, k + 8, generator=g) * 3).to(BF16)[:, :k]
    q, scale = quantize_rows(torch.randn(n, k, generator=g))
    panels = to_panels(q)
    colsum = F.pad(q.sum(dim=1, dtype=torch.int32), (0, panels.shape[0] * 64 - n))
    if not ops.int8_silu_fusable(x, n):
        assert amx_allowed and ops.cpu_has_amx()
        return
    for bias in (None, torch.randn(n, generator=g).to(BF16)):
        ref = ops.silu_and_mul(ops.linear_int8(x, panels, scale, colsum, bias, n, False))
        assert torch.equal(ops.linear_int8_silu_mul(x, panels, scale, colsum, bias, n), ref)
    assert not ops.int8_silu_fusable(x, 96) and not ops.int8_silu_fusable(x.float(), n)
    with pytest.raises(RuntimeError, match="n = 2 x a multiple of 64"):
        ops.linear_int8_silu_mul(x, panels, scale, colsum, None, 96)


@needs_avx2
@pytest.mark.parametrize("m", [1, 3])
def test_linear_int8_is_exact_at_the_largest_k_and_values(m, int8_row_kernel):
    """At K = 65536 (the most an int8 layer takes) with every product at its largest (|x16| =
    32767, |q| = 127, one sign), the kernels' int32 partial sums must not overflow: the result
    is the reference's (whose dot products are exact in int64) and the true value's."""
    k, n = 65536, 64
    q = torch.full((n, k), 127, dtype=torch.int8)
    q[1::2] = -127  # both signs of the whole sum
    scale = torch.ones(n)
    x = torch.ones(m, k)
    x[1:] = -1.0
    panels = to_panels(q)
    colsum = q.sum(dim=1, dtype=torch.int32)
    y = ops.linear_int8(x, panels, scale, colsum, None, n, True)
    ref = int8_linear(x, q, scale, None, torch.float32)
    assert torch.equal(y, ref)
    # x16 = +-32767 with scale 1 / 32767: y = +-127 k, to float32's rounding of the exact sum.
    sign = torch.tensor([1.0, -1.0]).repeat(n // 2)
    want = (x[:, :1] * sign[None, :] * 127 * k).float()
    torch.testing.assert_close(y, want, rtol=1e-6, atol=0)


@needs_avx2
def test_linear_int8_reads_strided_rows():
    x = torch.randn(5, 96).to(BF16)[:, :64]  # rows 96 apart
    q, scale = quantize_rows(torch.randn(32, 64))
    colsum = F.pad(q.sum(dim=1, dtype=torch.int32), (0, 32))
    y = ops.linear_int8(x, to_panels(q), scale, colsum, None, 32, True)
    assert torch.equal(y, int8_linear(x.contiguous(), q, scale, None, torch.float32))


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 768), (300, 96)])
def test_rms_norm_matches_torch(rows, hidden, dtype, monkeypatch):
    torch.manual_seed(rows)
    norm = RMSNorm(hidden, eps=1e-6)
    norm.weight.data = torch.randn(hidden).to(dtype)
    x = torch.randn(rows, hidden).to(dtype) * 3
    res = torch.randn(rows, hidden).to(dtype)
    fast_y, fast_res = norm(x, res.clone())
    fast_plain = norm(x)
    torch_path(monkeypatch)
    ref_y, ref_res = norm(x, res.clone())
    assert torch.equal(fast_res, ref_res)  # the residual sum: one rounding, same as torch
    # The mean of squares sums in another order: bf16 outputs at most one bf16 step apart and
    # mostly equal; fp32 ones a few ulps apart (a row's 1/rms may differ in its last bit).
    for fast, ref in ((fast_y, ref_y), (fast_plain, norm(x))):
        if dtype == BF16:
            torch.testing.assert_close(fast, ref, rtol=1e-2, atol=1e-2)
            assert (fast == ref).float().mean() > 0.95
        else:
            torch.testing.assert_close(fast, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("rows,d", [(1, 8), (7, 2048), (64, 100)])
def test_silu_and_mul_matches_torch(rows, d, dtype, monkeypatch):
    x = (torch.randn(rows, 2 * d) * 4).to(dtype)
    fast = SiluAndMul()(x)
    assert fast.dtype == dtype
    torch_path(monkeypatch)
    if dtype == BF16:
        assert torch.equal(fast, SiluAndMul()(x))
    else:  # exp differs from PyTorch's in the last bits
        torch.testing.assert_close(fast, SiluAndMul()(x), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("head_size,rotary_dim,heads,kv_heads", [(64, 64, 12, 4), (128, 64, 4, 4)])
def test_rope_matches_torch(head_size, rotary_dim, heads, kv_heads, dtype, monkeypatch):
    rope = get_rope(head_size, rotary_dim, 512, 10000.0)
    positions = torch.tensor([0, 1, 5, 511, 77])
    qkv = torch.randn(5, (heads + 2 * kv_heads) * head_size).to(dtype)
    q, k, _ = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], -1)
    ref_q, ref_k = q.clone(), k.clone()
    fast_q, fast_k = rope(positions, q, k)  # in place, through the split views
    assert fast_q.data_ptr() == q.data_ptr()
    torch_path(monkeypatch)
    ref_q, ref_k = rope(positions, ref_q, ref_k)
    assert torch.equal(fast_q, ref_q) and torch.equal(fast_k, ref_k)
    with pytest.raises(RuntimeError, match="out of the RoPE table"):
        ops.rotary_embedding(torch.tensor([512]), q[:1], k[:1], rope.cos_sin_cache, head_size, 64)


def test_elementwise_ops_refuse_mixed_dtypes():
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="weight must have the input's dtype"):
        ops.rms_norm(x, torch.ones(64, dtype=BF16), 1e-6)
    with pytest.raises(RuntimeError, match="x must be bfloat16 or float32"):
        ops.silu_and_mul(x.double())


def reference_decode(q, kv_cache, block_table, seq_lens, scale):
    """Per request: gather its K/V rows through the block table, SDPA in fp64."""
    _, _, bs, hkv, d = kv_cache.shape
    outs = []
    for b, length in enumerate(seq_lens.tolist()):
        blocks = block_table[b, : -(-length // bs)].long()
        k = kv_cache[0, blocks].reshape(-1, hkv, d)[:length].double()
        v = kv_cache[1, blocks].reshape(-1, hkv, d)[:length].double()
        qb = q[b].double()[None, :, None]  # [1, H, 1, D]
        o = F.scaled_dot_product_attention(
            qb, k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=scale, enable_gqa=True
        )
        outs.append(o[0, :, 0])
    return torch.stack(outs)


@pytest.mark.skipif(ops is None, reason="no native build")
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_reshape_and_cache(dtype):
    """The native KV write equals two index_copy_ calls: strided K/V rows (columns of a fused
    QKV output), padding rows after the slot mapping's, every other slot untouched; a slot
    outside the cache is an error, not a write."""
    g = torch.Generator().manual_seed(0)
    blocks, block_size, hkv, d, t, n = 7, 16, 3, 64, 40, 33
    qkv = torch.randn(t, (3 + 2) * hkv * d, generator=g).to(dtype)
    key = qkv[:, 3 * hkv * d : 4 * hkv * d].view(t, hkv, d)
    value = qkv[:, 4 * hkv * d :].view(t, hkv, d)
    slots = torch.randperm(blocks * block_size, generator=g)[:n]
    cache = torch.randn(2, blocks, block_size, hkv, d, generator=g).to(dtype)
    ref = cache.clone()
    ref[0].view(-1, hkv * d).index_copy_(0, slots, key[:n].reshape(n, -1))
    ref[1].view(-1, hkv * d).index_copy_(0, slots, value[:n].reshape(n, -1))
    ops.reshape_and_cache(key, value, cache, slots)
    assert torch.equal(cache, ref)
    with pytest.raises(RuntimeError, match="out of the KV cache"):
        ops.reshape_and_cache(key, value, cache, torch.tensor([blocks * block_size]))
    assert torch.equal(cache, ref)


@pytest.mark.parametrize(
    "heads,kv_heads,d,block_size,lens",
    [
        (12, 4, 64, 16, [1, 17, 200]),
        (4, 4, 128, 32, [33]),
        (8, 1, 80, 16, [5, 64, 1, 300]),
        (9, 3, 64, 16, [129, 2]),  # SmolLM2's heads
        (6, 2, 48, 16, [40, 3]),  # no vector kernel for head size 48: the portable one
        # AVX512-BF16 kernel: chunks shorter than 16 (block size 8, 24), query heads in
        # groups (7, 8 a KV head), every head size it takes.
        (14, 2, 64, 8, [9, 70]),
        # odd chunks (block size 5): token pairs of P V start at odd positions too
        (9, 3, 64, 5, [23, 4, 1]),
        (4, 1, 32, 16, [31, 16, 50]),
        (6, 2, 96, 24, [100, 7]),
        (2, 1, 256, 16, [45]),
        (16, 2, 128, 16, [77]),
    ],
)
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_paged_decode_attention(heads, kv_heads, d, block_size, lens, dtype):
    g = torch.Generator().manual_seed(sum(lens))
    num_blocks = 64
    kv = torch.randn(2, num_blocks, block_size, kv_heads, d, generator=g).to(dtype)
    max_blocks = max(-(-n // block_size) for n in lens) + 1
    table = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in lens]).int()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    scale = d**-0.5
    out = ops.paged_decode_attention(q, kv, table, seq_lens, max(lens), scale)
    assert out.dtype == dtype
    ref = reference_decode(q, kv, table, seq_lens, scale)
    tol = 2e-2 if dtype == BF16 else 2e-5  # bf16: the output's rounding
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def reference_prefill(q, kv_cache, block_table, seq_lens, qsl, reqs, scale):
    """Per request: its K/V rows through the block table; query row i (position
    seq_len - q_len + i) attends to keys 0 .. its position; SDPA in fp64."""
    _, _, bs, hkv, d = kv_cache.shape
    out = {}
    for r in reqs.tolist():
        length, start, end = int(seq_lens[r]), int(qsl[r]), int(qsl[r + 1])
        blocks = block_table[r, : -(-length // bs)].long()
        k = kv_cache[0, blocks].reshape(-1, hkv, d)[:length].double().transpose(0, 1)[None]
        v = kv_cache[1, blocks].reshape(-1, hkv, d)[:length].double().transpose(0, 1)[None]
        pos = torch.arange(length - (end - start), length)
        mask = torch.arange(length)[None, :] <= pos[:, None]  # [q_len, length]
        qr = q[start:end].double().transpose(0, 1)[None]  # [1, H, q_len, D]
        o = F.scaled_dot_product_attention(qr, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[r] = o[0].transpose(0, 1)
    return out


@needs_avx2
@pytest.mark.parametrize(
    "heads,kv_heads,d,block_size,spans",
    [
        (9, 3, 64, 16, [(0, 147), (0, 1), (100, 40), (0, 2), (31, 9)]),  # SmolLM2's heads
        (12, 4, 64, 16, [(0, 300), (16, 1), (5, 17)]),
        (4, 4, 128, 32, [(40, 33)]),
        (8, 1, 80, 16, [(0, 64), (3, 5)]),
        (4, 2, 32, 16, [(0, 20), (60, 20)]),
        (16, 2, 128, 8, [(0, 90), (200, 37), (7, 16)]),  # AMX: 8 query heads a KV head
    ],
)
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_paged_prefill_attention(heads, kv_heads, d, block_size, spans, dtype, amx_allowed):
    """Multi-token queries (spans: context, new rows) against fp64 SDPA with the bottom-right
    causal mask; rows of requests not asked for stay untouched; and a request's rows come out
    bit-identical in one call or in chunks (as chunked prefill and prefix caching split it),
    whatever else is in the call. bf16 with head size 64 / 128 takes the tile layout's kernel
    (AMX tiles, or AVX512-BF16 vectors with AMX off or absent), the rest the fp32 vector
    kernels."""
    g = torch.Generator().manual_seed(sum(c + n for c, n in spans) + d)
    num_blocks = 96
    lens = [c + n for c, n in spans]
    kv = torch.randn(2, num_blocks, block_size, kv_heads, d, generator=g).to(dtype)
    max_blocks = max(-(-n // block_size) for n in lens) + 1
    table = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in lens]).int()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    qsl = torch.tensor([0] + list(np.cumsum([n for _, n in spans])), dtype=torch.int64)
    t = int(qsl[-1])
    q = torch.randn(t + 3, heads, d, generator=g).to(dtype)  # 3 padding rows
    scale = d**-0.5
    reqs = torch.tensor([r for r, (_, n) in enumerate(spans) if n > 1 or r % 2], dtype=torch.int64)
    out = torch.full_like(q, 7.0)
    ops.paged_prefill_attention(q, out, kv, table, seq_lens, qsl, reqs, scale)
    ref = reference_prefill(q, kv, table, seq_lens, qsl, reqs, scale)
    tol = 2e-2 if dtype == BF16 else 2e-5
    done = torch.zeros(t + 3, dtype=torch.bool)
    for r, o in ref.items():
        rows = slice(int(qsl[r]), int(qsl[r + 1]))
        torch.testing.assert_close(out[rows].double(), o, rtol=tol, atol=tol)
        done[rows] = True
    assert (out[~done] == 7.0).all()
    # The last request again, its rows split in two calls (context grows by the first part).
    r = int(reqs[-1])
    ctx, n = spans[r]
    if n > 1:
        cut = n // 2
        rows = slice(int(qsl[r]), int(qsl[r + 1]))
        one = torch.empty_like(q[rows])
        for c0, c1 in ((0, cut), (cut, n)):
            sub_out = torch.empty(c1 - c0, heads, d, dtype=dtype)
            ops.paged_prefill_attention(
                q[rows][c0:c1].contiguous(),
                sub_out,
                kv,
                table[r : r + 1],
                torch.tensor([ctx + c1], dtype=torch.int32),
                torch.tensor([0, c1 - c0]),
                torch.tensor([0]),
                scale,
            )
            one[c0:c1] = sub_out
        assert torch.equal(one, out[rows])


def _projection(kind: str, n: int, k: int, g: torch.Generator, dtype: torch.dtype) -> tuple:
    """A projection's arguments as the fused layer ops take them (layers/cpu_fused.py)."""
    w = torch.randn(n, k, generator=g) / k**0.5
    if kind == "int8":
        q, scale = quantize_rows(w)
        panels = to_panels(q)
        colsum = F.pad(q.sum(1, dtype=torch.int32), (0, panels.shape[0] * 64 - n))
        return (1, panels, scale, colsum, None, n)
    if kind == "bf16":
        return (2, to_panels(w.to(BF16)), None, None, None, n)
    return (0, to_panels(w.to(dtype), 1), None, None, None, n)


def _project(x: torch.Tensor, p: tuple) -> torch.Tensor:
    kind, panels, scale, colsum, bias, n = p
    if kind == 1:
        return ops.linear_int8(x, panels, scale, colsum, bias, n, False)
    if kind == 2:
        return ops.linear(x, panels, bias, n, False)
    return ops.linear_avx2(x, panels, bias, n, False)


@needs_avx2
@pytest.mark.parametrize("kind", ["avx2", "int8", "bf16"])
@pytest.mark.parametrize("rows", [7, 600, 1025])
@pytest.mark.parametrize("qk_norm, d", [(False, 32), (True, 32), (True, 128)])
def test_attention_in_is_the_separate_ops(kind, rows, qk_norm, d):
    """The fused op runs the (residual add +) RMSNorm, the QKV projection, the per-head q/k
    RMSNorm (Qwen3's, when given) and RoPE exactly as the separate ops do, a prefill in row
    chunks (600 rows: two; 1025: two, the one-row remainder joined to the last) included: the
    same bits, and the same residual stream left behind."""
    if kind == "bf16" and not ops.cpu_has_avx512_bf16():
        pytest.skip("no AVX512-BF16 on this CPU")
    g = torch.Generator().manual_seed(rows)
    dtype, hidden, heads, kv_heads = BF16, 128, 4, 2
    q_size, kv_size = heads * d, kv_heads * d
    qkv_p = _projection(kind, q_size + 2 * kv_size, hidden, g, dtype)
    rope = get_rope(d, d, 4096, 10000.0)
    positions = torch.randint(0, 4096, (rows,), generator=g)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    norm = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    head_norms = [(torch.rand(d, generator=g) + 0.5).to(dtype) for _ in range(2)]
    qk_args = (*head_norms, 1e-6) if qk_norm else ()

    def fused(residual, *extra):
        rope_args = (positions, rope.cos_sin_cache, d, d)
        return ops.attention_in(
            x, residual, norm, 1e-5, *qkv_p, q_size, kv_size, *rope_args, *extra
        )

    for residual in (None, torch.randn(rows, hidden, generator=g).to(dtype)):
        res_ref = None if residual is None else residual.clone()
        res_plain = None if residual is None else residual.clone()
        if residual is None:
            h = ops.rms_norm(x, norm, 1e-5)
        else:
            h = ops.fused_add_rms_norm(x, res_ref, norm, 1e-5)
        ref = _project(h, qkv_p)
        q, k = ref[:, :q_size], ref[:, q_size : q_size + kv_size]
        if qk_norm:  # each head a row, as Qwen3's attention module runs them
            q.copy_(ops.rms_norm(q.reshape(-1, d), head_norms[0], 1e-6).view(rows, q_size))
            k.copy_(ops.rms_norm(k.reshape(-1, d), head_norms[1], 1e-6).view(rows, kv_size))
        ops.rotary_embedding(positions, q, k, rope.cos_sin_cache, d, d)
        out = fused(residual, *qk_args)
        assert torch.equal(out, ref)
        assert residual is None or torch.equal(residual, res_ref)
        if qk_norm:  # the norms act: without them q and k differ, v does not
            plain = fused(res_plain)
            width = q_size + kv_size
            assert not torch.equal(out[:, :width], plain[:, :width])
            assert torch.equal(out[:, width:], plain[:, width:])


@needs_avx2
def test_attention_in_refuses_half_the_qk_norms():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g)
    qkv_p = _projection("avx2", 4 * 32, 64, g, torch.float32)
    rope = get_rope(32, 32, 64, 10000.0)
    args = (x, None, torch.ones(64), 1e-5, *qkv_p, 64, 32, torch.arange(3), rope.cos_sin_cache)
    w = torch.ones(32)
    with pytest.raises(RuntimeError, match="q_norm and k_norm go together"):
        ops.attention_in(*args, 32, 32, w, None, 1e-6)
    with pytest.raises(RuntimeError, match=r"q_norm / k_norm: \[head_size\]"):
        ops.attention_in(*args, 32, 32, w, torch.ones(16), 1e-6)


@needs_avx2
@pytest.mark.parametrize("kind", ["avx2", "int8", "bf16"])
@pytest.mark.parametrize("rows", [7, 1025, 1100])
def test_attention_out_mlp_is_the_separate_ops(kind, rows):
    """The fused op runs o_proj, the residual add + RMSNorm, gate/up, SiLU x mul and down
    exactly as the separate ops do, a prefill's MLP in row chunks (1100 rows: three, the down
    projection writing straight into the output's rows; 1025: two, the one-row remainder
    joined to the last) included: the same bits, and the same residual stream left behind."""
    if kind == "bf16" and not ops.cpu_has_avx512_bf16():
        pytest.skip("no AVX512-BF16 on this CPU")
    g = torch.Generator().manual_seed(rows)
    dtype, hidden, inter = BF16, 128, 192
    o, gate_up, down = (
        _projection(kind, n, k, g, dtype)
        for n, k in ((hidden, hidden), (2 * inter, hidden), (hidden, inter))
    )
    attn = torch.randn(rows, hidden, generator=g).to(dtype)
    residual = torch.randn(rows, hidden, generator=g).to(dtype)
    norm = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    res_ref = residual.clone()
    h = ops.fused_add_rms_norm(_project(attn, o), res_ref, norm, 1e-5)
    ref = _project(ops.silu_and_mul(_project(h, gate_up)), down)
    out = ops.attention_out_mlp(attn, residual, *o, norm, 1e-5, *gate_up, *down)
    assert torch.equal(out, ref) and torch.equal(residual, res_ref)


@needs_avx2
@pytest.mark.parametrize("kind", ["avx2", "int8", "bf16"])
@pytest.mark.parametrize("qk_norm, d", [(False, 64), (True, 64), (True, 128)])
@pytest.mark.parametrize(
    "cache_dtype, kv_scales",
    [
        (BF16, (1.0, 1.0)),
        (torch.float8_e4m3fn, (1.0, 1.0)),
        (torch.float8_e5m2, (1.0, 1.0)),
        (torch.float8_e4m3fn, (0.043, 1.9)),  # calculate_kv_scales' scales
    ],
)
def test_decoder_layer_decode_is_the_separate_ops(kind, qk_norm, d, cache_dtype, kv_scales):
    """A decode-only step's whole layer in one call (FusedStack's op) is attention_in (norms,
    QKV, the per-head q/k norms when given, RoPE), the K/V write, decode attention over the
    paged cache and attention_out_mlp, bit for bit: the same output, residual and cache (in
    the model's dtype or fp8, with its K/V scales)."""
    if kind == "bf16" and not ops.cpu_has_avx512_bf16():
        pytest.skip("no AVX512-BF16 on this CPU")
    g = torch.Generator().manual_seed(d)
    dtype, hidden, heads, kv_heads, inter, bs = BF16, 128, 4, 2, 192, 16
    q_size, kv_size = heads * d, kv_heads * d
    qkv_p, o, gate_up, down = (
        _projection(kind, n, k, g, dtype)
        for n, k in ((q_size + 2 * kv_size, hidden), (hidden, q_size), (2 * inter, hidden),
                     (hidden, inter))
    )  # fmt: skip
    norms = [(torch.rand(hidden, generator=g) + 0.5).to(dtype) for _ in range(2)]
    head_norms = tuple((torch.rand(d, generator=g) + 0.5).to(dtype) for _ in range(2))
    qk_args = (*head_norms, 1e-6) if qk_norm else (None, None, 0.0)
    rope = get_rope(d, d, 4096, 10000.0)
    seq_lens = torch.tensor([1, 17, 40, 33, 16], dtype=torch.int32)  # the new token included
    B, blocks_per_req = len(seq_lens), 3
    num_blocks = B * blocks_per_req
    table = torch.randperm(num_blocks, generator=g).int().view(B, blocks_per_req)
    positions = seq_lens.long() - 1
    slots = torch.stack([table[b, p // bs] * bs + p % bs for b, p in enumerate(positions)]).long()
    cache = torch.randn(2, num_blocks, bs, kv_heads, d, generator=g).to(cache_dtype)
    x = torch.randn(B, hidden, generator=g).to(dtype)
    residual = torch.randn(B, hidden, generator=g).to(dtype)
    scale, max_len = d**-0.5, int(seq_lens.max())

    res_ref, cache_ref = residual.clone(), cache.clone()
    rope_args = (positions, rope.cos_sin_cache, d, d)
    qkv = ops.attention_in(
        x, res_ref, norms[0], 1e-5, *qkv_p, q_size, kv_size, *rope_args, *qk_args
    )
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=1)
    k, v = k.reshape(B, kv_heads, d), v.reshape(B, kv_heads, d)
    ops.reshape_and_cache(k, v, cache_ref, slots, *kv_scales)
    attn = ops.paged_decode_attention(
        q.reshape(B, heads, d), cache_ref, table, seq_lens, max_len, scale, *kv_scales
    )
    ref = ops.attention_out_mlp(attn.view(B, q_size), res_ref, *o, norms[1], 1e-5, *gate_up, *down)
    out = ops.decoder_layer_decode(
        x, residual, norms[0], 1e-5, *qkv_p, q_size, kv_size, *rope_args, cache, slots, table,
        seq_lens, max_len, scale, *o, norms[1], 1e-5, *gate_up, *down, *qk_args, *kv_scales,
    )  # fmt: skip
    assert torch.equal(out, ref)
    assert torch.equal(residual, res_ref)
    assert torch.equal(cache.view(torch.uint8), cache_ref.view(torch.uint8))


_NO_AMX_CHECK = """
import torch, torch.nn.functional as F
from pagedllm.layers.cpu_gemm import to_panels
from pagedllm.ops import cpu_ops
ops = cpu_ops()
assert not ops.cpu_has_amx()
g = torch.Generator().manual_seed(0)
x = torch.randn(40, 96, generator=g).to(torch.bfloat16)
w = (torch.randn(80, 96, generator=g) * 0.1).to(torch.bfloat16)
panels = to_panels(w)
y = ops.linear(x, panels, None, 80, True)
assert all(torch.equal(ops.linear(x[i : i + 1], panels, None, 80, True), y[i : i + 1]) for i in range(40))
torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2)
print("ok")
"""


@needs_bf16
@pytest.mark.parametrize("value", ["0", "off"])
def test_amx_can_be_turned_off(value):
    """PAGEDLLM_CPU_AMX=0 (or off / false / no) keeps the tiles unused: products of many rows
    run the AVX-512 kernel an AMX-less CPU runs, so a row's bits are its batch-of-one bits."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PAGEDLLM_CPU_AMX=value)
    out = subprocess.run(
        [sys.executable, "-c", _NO_AMX_CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
