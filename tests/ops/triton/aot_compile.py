"""Compile every Triton kernel ahead of time for an NVIDIA target (no GPU needed: Triton
ships ptxas) and print one line per variant. Run in a process without TRITON_INTERPRET (the
kernels must be defined as compiled ones): `python -m tests.ops.triton.aot_compile [ARCH]
[fp8]` (fp8: only the variants over fp8 caches)."""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pagedllm.ops.triton import (  # noqa: E402
    rejection_sample,
    reshape_and_cache,
    top_k_top_p,
    unified_attention,
)


def _variants():
    """(kernel, runtime arg types, constexprs) per variant: the dtypes and head shapes served,
    and the constant 1 Triton substitutes for an int argument equal to 1."""
    # (query dtype, cache pointer, FP8): caches in the model's dtype, and fp8 caches (their
    # bytes, e4m3 and e5m2) under bf16 and fp32 queries.
    caches = [(dt, dt, 0) for dt in ("bf16", "fp32")]
    caches += [(dt, "u8", fp8) for dt in ("bf16", "fp32") for fp8 in (1, 2)]
    for dt, cache, fp8 in caches:
        precision = "ieee" if dt == "fp32" else None
        shapes = ((4, 128, "i32"), (1, 64, 1), (8, 80, "i32")) if not fp8 else ((4, 128, "i32"),)
        for group, head, num_seqs in shapes:
            block_m = max(16, group)
            yield (
                unified_attention._unified_attention_kernel,
                {
                    "out_ptr": f"*{dt}",
                    "q_ptr": f"*{dt}",
                    "k_cache_ptr": f"*{cache}",
                    "v_cache_ptr": f"*{cache}",
                    "block_table_ptr": "*i32",
                    "seq_lens_ptr": "*i32",
                    "query_start_loc_ptr": "*i32",
                    "scale": "fp32",
                    "k_scale": "fp32",
                    "v_scale": "fp32",
                    "num_seqs": num_seqs,
                    **dict.fromkeys(
                        (
                            "stride_q_t",
                            "stride_q_h",
                            "stride_o_t",
                            "stride_o_h",
                            "stride_c_blk",
                            "stride_c_slot",
                            "stride_c_head",
                            "stride_bt",
                        ),
                        "i64",
                    ),
                },
                dict(
                    BLOCK_SIZE=16,
                    QUERIES_PER_KV=group,
                    HEAD_SIZE=head,
                    HEAD_PAD=triton.next_power_of_2(head),
                    BLOCK_M=block_m,
                    BLOCK_Q=block_m // group,
                    TILE=32,
                    DOT_PRECISION=precision,
                    FP8=fp8,
                ),
            )
        if dt == "fp32" and fp8:
            continue  # (the fp8 stores: from bf16 rows below)
        yield (
            reshape_and_cache._reshape_and_cache_kernel,
            {
                "key_ptr": f"*{dt}",
                "value_ptr": f"*{dt}",
                "k_cache_ptr": f"*{cache}",
                "v_cache_ptr": f"*{cache}",
                "slot_mapping_ptr": "*i64",
                "k_inv": "fp32",
                "v_inv": "fp32",
                **dict.fromkeys(
                    (
                        "stride_k_t",
                        "stride_k_h",
                        "stride_v_t",
                        "stride_v_h",
                        "stride_c_blk",
                        "stride_c_slot",
                        "stride_c_head",
                    ),
                    "i64",
                ),
            },
            dict(BLOCK_SIZE=16, NUM_KV_HEADS=8, HEAD_SIZE=128, HEADS_PAD=8, HEAD_PAD=128, FP8=fp8),
        )
    for has_k, has_p in ((True, True), (True, False), (False, True)):
        yield (
            top_k_top_p._top_k_top_p_kernel,
            {
                "logits_ptr": "*fp32",
                "top_k_ptr": "*i64",
                "top_p_ptr": "*fp32",
                "vocab_size": "i32",
                "stride_row": "i64",
            },
            dict(HAS_TOP_K=has_k, HAS_TOP_P=has_p, BLOCK=256),
        )
    for has_q in (True, False):
        yield (
            rejection_sample._accept_recover_kernel,
            {
                "probs_ptr": "*fp32",
                "q_ptr": "*fp32",
                "drafts_ptr": "*i64",
                "is_draft_ptr": "*i1",
                "u_accept_ptr": "*fp32",
                "u_recover_ptr": "*fp32",
                "accept_ptr": "*i1",
                "recovered_ptr": "*i64",
                "vocab_size": "i32",
                "stride_p": "i64",
                "stride_q": "i64",
            },
            dict(HAS_Q=has_q, BLOCK=1024),
        )


def main(arch: int, fp8_only: bool = False) -> None:
    target = GPUTarget("cuda", arch, 32)
    for kernel, types, constexprs in _variants():
        if fp8_only and not constexprs.get("FP8"):
            continue
        signature = dict(types)
        consts = {}
        for name, value in list(signature.items()) + list(constexprs.items()):
            if not isinstance(value, str) or name in constexprs:
                signature[name] = "constexpr"
                consts[(kernel.arg_names.index(name),)] = value
        assert list(signature) == kernel.arg_names, (list(signature), kernel.arg_names)
        compiled = triton.compile(ASTSource(kernel, signature, consts), target=target)
        print(
            f"sm_{arch} {kernel.__name__} {sorted(constexprs.items(), key=str)}: "
            f"{len(compiled.asm['cubin'])} bytes of cubin"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90, "fp8" in sys.argv[2:])
