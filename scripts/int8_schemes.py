"""Which int8 scheme keeps a real model's greedy tokens: simulated in PyTorch on the
transformers model (fake quantization, fp32 products), teacher-forced against bf16's own
greedy continuation of `pagedllm.testing.agreement`'s chat prompts (the share of its tokens each variant
also ranks first, every position seeing the same prefix), and free-running (tokens before
the first disagreement).

    python scripts/int8_schemes.py MODEL_DIR [--tokens 64]

Variants: fp32 (rounding alone), per-channel int8 weights with bf16 / fp32 activations
(weight-only, what issue 12 names), with activations per row as uint8 over [min, 0] .. [0, max]
(W8A8, what `quantization="int8"` ran until it took 16-bit rows), as symmetric int16 (W8A16,
what it runs now: layers/quantization.py) or as uint16 with a zero point. The LM head stays unquantized unless the name says "+ head".
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedllm.layers.quantization import quantize_activations, quantize_rows
from pagedllm.testing.agreement import CHAT_PROMPTS as PROMPTS


def act_u8(x: torch.Tensor) -> torch.Tensor:
    """Rows as uint8 over [min(x, 0), max(x, 0)] with a zero point and back (W8A8)."""
    return _asymmetric(x, 255)


def act_u16(x: torch.Tensor) -> torch.Tensor:
    """The same with 65535 levels instead of 255."""
    return _asymmetric(x, 65535)


def _asymmetric(x: torch.Tensor, levels: int) -> torch.Tensor:
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    span = (x.amax(-1, keepdim=True).clamp(min=0) - lo).clamp(min=1e-12)
    inv = levels / span
    zero = (-lo * inv).round()
    return (((x * inv).round() + zero).clamp(0, levels) - zero) / inv


def act_s16(x: torch.Tensor) -> torch.Tensor:
    """Rows through `quantize_activations` (what the int8 engine computes) and back."""
    xq, scale = quantize_activations(x.reshape(-1, x.shape[-1]))
    return (xq.float() * scale[:, None]).reshape(x.shape)


def quantize(model: torch.nn.Module, acts, head: bool) -> None:
    """Every linear layer's weight through `quantize_rows` (int8_linear's per-channel int8) and
    back; with `acts`, its input rows too, the product in fp32."""
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or ("lm_head" in name and not head):
            continue
        q, scale = quantize_rows(mod.weight.data)
        mod.weight.data = (q.float() * scale[:, None]).to(mod.weight.dtype)
        if acts is not None:

            def forward(x, mod=mod, acts=acts):
                bias = None if mod.bias is None else mod.bias.float()
                return F.linear(acts(x.float()), mod.weight.float(), bias).to(x.dtype)

            mod.forward = forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in PROMPTS
    ]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    L, T = enc["input_ids"].shape[1], args.tokens

    def load(dtype):
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()

    @torch.no_grad()
    def generate(model):
        return model.generate(
            **enc,
            max_new_tokens=T,
            min_new_tokens=T,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )

    ref = generate(load(torch.bfloat16))  # [B, L + T]
    mask = torch.cat([enc["attention_mask"], torch.ones(ref.shape[0], T, dtype=torch.long)], 1)

    @torch.no_grad()
    def measure(model) -> tuple[float, float]:
        pred = model(input_ids=ref, attention_mask=mask).logits[:, L - 1 : L - 1 + T].argmax(-1)
        forced = (pred == ref[:, L:]).float().mean().item()
        free = generate(model)[:, L:]
        same = (free == ref[:, L:]).long()
        before_first = same.cumprod(1).sum().item() / same.numel()
        return forced, before_first

    variants = [
        ("bf16 (the reference, teacher-forced)", torch.bfloat16, False, None, False),
        ("fp32", torch.float32, False, None, False),
        ("int8 weight-only, bf16", torch.bfloat16, True, None, False),
        ("int8 weight-only, fp32", torch.float32, True, None, False),
        ("W8A8 uint8 (before W8A16)", torch.bfloat16, True, act_u8, False),
        ("W8A8 uint8 + head", torch.bfloat16, True, act_u8, True),
        ("W8A16 int16 (quantization='int8')", torch.bfloat16, True, act_s16, False),
        ("W8A16 uint16 with a zero point", torch.bfloat16, True, act_u16, False),
    ]
    print(f"{len(PROMPTS)} prompts x {T} tokens against bf16 greedy")
    for name, dtype, int8, acts, head in variants:
        model = load(dtype)
        if int8:
            quantize(model, acts, head)
        forced, free = measure(model)
        print(f"  {name:38s} teacher-forced top-1 {forced:6.1%}   free-running {free:6.1%}")


if __name__ == "__main__":
    main()
