"""Train EAGLE and Medusa heads for a copy model (`pagedllm.testing.copy_model`), the target
frozen, on the periodic sequences it was trained on; written in the formats eagle.py and
medusa.py load (the layouts of `make_eagle_head` / `make_medusa_heads`).

Usage: python -m pagedllm.spec_decode.train_heads {eagle,medusa} TARGET_DIR OUT_DIR [--steps N]

The target's features are its last hidden states (after the final norm), from transformers in
fp32. Medusa (the Medusa-1 recipe): head i reads the feature at p and is trained with cross
entropy on token p + 2 + i; its residual block starts at zero and its LM head as a copy of the
target's, so it starts out predicting token p + 1. EAGLE-1: one Llama layer (no input norm) over
fc([embedding of t_{p+1}, f_p]) regresses f_{p+1} (smooth L1) and matches the target's
next-token distribution through the target's frozen LM head (cross entropy, weight 0.1), the
input features jittered by uniform noise; the head shares the target's embedding and LM head.
Llama-family targets only.
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pagedllm.spec_decode.testing import eagle_config, medusa_config, save_head
from pagedllm.testing.copy_model import MAX_PERIOD, copy_alphabet, periodic_batch, train_periodic


class _ResBlock(nn.Module):
    """`num_layers` times x = x + SiLU(linear(x)); the linears start at zero."""

    def __init__(self, hidden: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(num_layers))
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    """Medusa heads with vLLM's tensor names (`blocks.{i}.layers.{j}.*`, `lm_heads.{i}.*`)."""

    def __init__(self, lm_head: nn.Linear, num_heads: int, num_layers: int) -> None:
        super().__init__()
        hidden = lm_head.in_features
        self.blocks = nn.ModuleList(_ResBlock(hidden, num_layers) for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(copy.deepcopy(lm_head) for _ in range(num_heads))
        for head in self.lm_heads:
            head.weight.requires_grad_(True)

    def forward(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """hidden [B, T, H] -> per head, logits [B, T, V]."""
        return [head(block(hidden)) for block, head in zip(self.blocks, self.lm_heads)]


class EagleHead(nn.Module):
    """The EAGLE-1 head eagle.py runs, with its tensor names (`fc.*`, `layers.0.*`)."""

    def __init__(self, target_config: Any) -> None:
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRotaryEmbedding,
        )

        super().__init__()
        hidden = target_config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([LlamaDecoderLayer(target_config, layer_idx=0)])
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary = LlamaRotaryEmbedding(target_config)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Embeddings of t_{p+1} and features f_p, [B, T, H] each -> predicted f_{p+1}."""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        seq_len = x.shape[1]
        positions = torch.arange(seq_len)[None]
        causal = torch.full((seq_len, seq_len), float("-inf")).triu(1)[None, None]
        return self.layers[0](
            x,
            attention_mask=causal,
            position_ids=positions,
            position_embeddings=self.rotary(x, positions),
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            k: v.detach() for k, v in self.state_dict().items() if k.startswith(("fc.", "layers."))
        }


def _load_target(target_dir: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    model.requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(target_dir)


def _features(target: Any, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """batch [B, T] -> (last hidden states [B, T, H], logits [B, T, V]) of the frozen target."""
    with torch.no_grad():
        out = target(input_ids=batch, output_hidden_states=True)
    return out.hidden_states[-1], out.logits


def _medusa_losses(
    heads: MedusaHeads, target: Any, batch: torch.Tensor, held_out: bool
) -> dict[str, torch.Tensor]:
    """Per head i, cross entropy and top-1 accuracy on token p + 2 + i (held out: positions
    p >= MAX_PERIOD only); "loss": their mean cross entropy."""
    hidden, _ = _features(target, batch)
    first = MAX_PERIOD if held_out else 0
    out = {}
    for i, logits in enumerate(heads(hidden[:, first:])):
        shift = 2 + i
        pred = logits[:, : batch.shape[1] - first - shift]
        labels = batch[:, first + shift :]
        out[f"head{i}_ce"] = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), labels.reshape(-1))
        out[f"head{i}_top1"] = (pred.argmax(-1) == labels).float().mean()
    out["loss"] = sum(out[f"head{i}_ce"] for i in range(len(heads.blocks))) / len(heads.blocks)
    return out


def _eagle_losses(
    head: EagleHead,
    target: Any,
    batch: torch.Tensor,
    held_out: bool,
    noise: float,
    ce_weight: float,
) -> dict[str, torch.Tensor]:
    """The head's rows p (inputs t_{p+1} and f_p, jittered by uniform noise of width `noise`
    in training): smooth L1 to f_{p+1}, cross entropy to the target's next-token distribution
    at p + 1, top-1 agreement with its argmax; "loss": smooth L1 + ce_weight * cross entropy.
    Held out: rows p >= MAX_PERIOD, no noise."""
    features, logits = _features(target, batch)
    first = MAX_PERIOD if held_out else 0
    inputs = features[:, :-1]
    if not held_out:
        inputs = inputs + (torch.rand_like(inputs) - 0.5) * noise
    pred = head(target.model.embed_tokens(batch[:, 1:]), inputs)[:, first:]
    want, want_logits = features[:, first + 1 :], logits[:, first + 1 :]
    pred_logits = target.lm_head(pred)
    feature_loss = F.smooth_l1_loss(pred, want)
    ce = -(want_logits.softmax(-1) * pred_logits.log_softmax(-1)).sum(-1).mean()
    return {
        "loss": feature_loss + ce_weight * ce,
        "feature_loss": feature_loss,
        "ce": ce,
        "top1": (pred_logits.argmax(-1) == want_logits.argmax(-1)).float().mean(),
    }


def _train_head(
    target_dir: str,
    make_head: Callable[[Any], nn.Module],
    losses: Callable[[Any, Any, torch.Tensor, bool], dict[str, torch.Tensor]],
    *,
    steps: int,
    lr: float,
    alphabet: int = 64,
    batch_size: int = 16,
    seq_len: int = 128,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, float]]:
    """Load the frozen target, train `make_head(target)` on `losses(head, target, batch,
    False)["loss"]` over periodic batches of its copy alphabet; returns the head and
    `losses(..., True)` on a fresh batch of 4 * batch_size rows."""
    target, tokenizer = _load_target(target_dir)
    tokens = copy_alphabet(tokenizer, alphabet)
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    head = make_head(target)
    train_periodic(
        lambda batch: losses(head, target, batch, False)["loss"],
        head.parameters(),
        tokens,
        generator,
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        lr=lr,
    )
    with torch.no_grad():
        batch = periodic_batch(tokens, 4 * batch_size, seq_len, generator)
        return head, {k: float(v) for k, v in losses(head, target, batch, True).items()}


def train_medusa_heads(
    path: str | os.PathLike,
    target_dir: str,
    *,
    num_heads: int = 3,
    num_layers: int = 1,
    steps: int = 1000,
    lr: float = 3e-3,
    **options: Any,
) -> tuple[str, dict[str, float]]:
    """Train Medusa heads for the copy model `target_dir`, write them to `path`; returns
    (path, held-out per-head cross entropy and top-1 accuracy after the longest period).
    `options`: `_train_head`'s alphabet (64), batch_size (16), seq_len (128), seed (0)."""
    heads, stats = _train_head(
        target_dir,
        lambda target: MedusaHeads(target.lm_head, num_heads, num_layers),
        _medusa_losses,
        steps=steps,
        lr=lr,
        **options,
    )
    tensors = {k: v.detach() for k, v in heads.state_dict().items()}
    config = medusa_config(target_dir, num_heads, num_layers)
    return save_head(os.fspath(path), config, tensors), stats


def train_eagle_head(
    path: str | os.PathLike,
    target_dir: str,
    *,
    steps: int = 500,
    lr: float = 1e-3,
    noise: float = 0.2,
    ce_weight: float = 0.1,
    **options: Any,
) -> tuple[str, dict[str, float]]:
    """Train an EAGLE-1 head for the copy model `target_dir`, write it to `path`; returns
    (path, held-out losses and top-1 agreement with the target after the longest period,
    from the target's features: one draft step). `options`: as `train_medusa_heads`'s."""
    head, stats = _train_head(
        target_dir,
        lambda target: EagleHead(target.config),
        lambda *a: _eagle_losses(*a, noise=noise, ce_weight=ce_weight),
        steps=steps,
        lr=lr,
        **options,
    )
    return save_head(os.fspath(path), eagle_config(target_dir), head.tensors()), stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("method", choices=["eagle", "medusa"])
    parser.add_argument("target", help="a pagedllm.testing.copy_model checkpoint")
    parser.add_argument("path", help="output directory")
    parser.add_argument("--steps", type=int, help="default: eagle 500, medusa 1000")
    parser.add_argument("--lr", type=float, help="default: eagle 1e-3, medusa 3e-3")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--alphabet", type=int, help="the target's copy alphabet (64)")
    parser.add_argument("--num-heads", type=int, help="Medusa heads (3)")
    parser.add_argument("--seed", type=int)
    args = vars(parser.parse_args(argv))
    method, target, path = args.pop("method"), args.pop("target"), args.pop("path")
    kwargs = {k: v for k, v in args.items() if v is not None}
    if method == "eagle" and "num_heads" in kwargs:
        parser.error("--num-heads is for medusa")
    train = train_eagle_head if method == "eagle" else train_medusa_heads
    t0 = time.perf_counter()
    path, stats = train(path, target, **kwargs)
    held_out = ", ".join(f"{k} {v:.3f}" for k, v in stats.items())
    print(f"{path}: {method} trained in {time.perf_counter() - t0:.0f}s; held out: {held_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
