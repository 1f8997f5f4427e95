"""Medusa proposer: k heads on the target's last hidden state each guess one future token.

With h the target's hidden state at the last valid position (the one whose logits produced
the token just sampled, t_{N-1}), head i (0-based) predicts t_{N+i}:

    x_i = ResBlock_i(h)       # L times: x = x + SiLU(W x + b)
    d_{i+1} = argmax lm_head_i(x_i)

All heads read the same h, so one batched call drafts all k tokens; there is no KV cache.
Drafts are argmax picks for every request, sampling ones included: the rejection sampler
treats them as drawn from a one-hot q (drawing from the heads' distributions is not done).

Checkpoint formats: vLLM's `MedusaModel` (config.json: architectures ["MedusaModel"],
`num_heads`, `num_hidden_layers`, `hidden_size`, `vocab_size`, optional `medusa_fc_bias`,
`original_lm_head`, `truncated_vocab_size`; tensors `blocks.{i}.layers.{j}.weight/bias`,
`lm_heads.{i}.weight`, possibly under a `medusa_heads.` prefix), and the original Medusa
release (`medusa_num_heads` / `medusa_num_layers`; tensors `{i}.{j}.linear.weight/bias` and
`{i}.{L}.weight`, possibly under `medusa_head.`). With `original_lm_head` the heads share the
target's LM head.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.sample import ops
from pagedllm.spec_decode.config import medusa_num_heads
from pagedllm.spec_decode.proposer import (
    DraftBatch,
    Proposal,
    Proposer,
    checkpoint_tensor_names,
    draft_limits,
    load_head,
)

_ORIGINAL_BLOCK = re.compile(r"^(\d+)\.(\d+)\.linear\.(weight|bias)$")
_ORIGINAL_HEAD = re.compile(r"^(\d+)\.(\d+)\.weight$")


class ResidualBlock(nn.Module):
    """`num_layers` times x = x + SiLU(linear(x))."""

    def __init__(self, hidden_size: int, num_layers: int, bias: bool, prefix: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            ReplicatedLinear(hidden_size, hidden_size, bias=bias, prefix=f"{prefix}.layers.{j}")
            for j in range(num_layers)
        )
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + self.act(layer(x))
        return x


class MedusaModel(nn.Module):
    """`num_heads` residual blocks, each with its own LM head unless `original_lm_head`."""

    def __init__(
        self, *, hf_config: Any, num_heads: int, num_layers: int, bias: bool, own_heads: bool
    ) -> None:
        super().__init__()
        hidden, vocab = hf_config.hidden_size, hf_config.vocab_size
        self.num_layers = num_layers
        self.blocks = nn.ModuleList(
            ResidualBlock(hidden, num_layers, bias, prefix=f"medusa.blocks.{i}")
            for i in range(num_heads)
        )
        self.lm_heads = (
            nn.ModuleList(
                ReplicatedLinear(hidden, vocab, bias=False, prefix=f"medusa.lm_heads.{i}")
                for i in range(num_heads)
            )
            if own_heads
            else None
        )

    def forward(self, hidden: torch.Tensor, num_heads: int) -> list[torch.Tensor]:
        """hidden [S, H] -> the first `num_heads` heads' features, each [S, H]."""
        return [self.blocks[i](hidden) for i in range(num_heads)]

    def _canonical(self, name: str) -> str:
        name = name.removeprefix("medusa_heads.").removeprefix("medusa_head.")
        m = _ORIGINAL_BLOCK.match(name)
        if m:
            return f"blocks.{m[1]}.layers.{m[2]}.{m[3]}"
        m = _ORIGINAL_HEAD.match(name)
        if m and int(m[2]) == self.num_layers:
            return f"lm_heads.{m[1]}.weight"
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            param_name = self._canonical(name)
            if param_name.startswith("lm_heads.") and self.lm_heads is None:
                continue
            param = params.get(param_name)
            if param is None:
                raise ValueError(f"Medusa checkpoint tensor {name!r} matches no head parameter")
            param.weight_loader(param, tensor)
            loaded.add(param_name)
        return loaded


class MedusaProposer(Proposer):
    """Drafts the first k Medusa heads' argmax tokens for every sampling request."""

    def __init__(self, config: Any, spec: Any, device: torch.device) -> None:
        self.spec = spec
        self.k = spec.num_speculative_tokens
        self.dtype = config.model_config.dtype
        self.load_format = config.load_config.load_format
        self.device = device
        self.model: MedusaModel | None = None

    def load_model(self, target_model: nn.Module) -> None:
        self.target = target_model
        hf = self.spec.draft_model_config.hf_config
        num_heads = medusa_num_heads(hf)
        num_layers = int(
            getattr(hf, "medusa_num_layers", None) or getattr(hf, "num_hidden_layers", None) or 1
        )
        truncated = getattr(hf, "truncated_vocab_size", None)
        if truncated is not None and truncated != hf.vocab_size:
            raise ValueError(
                f"speculative_config.model={self.spec.model!r}: truncated_vocab_size="
                f"{truncated} (a token map) is not supported; the heads must cover the whole "
                f"vocabulary of {hf.vocab_size}"
            )
        names = checkpoint_tensor_names(self.spec.model, self.load_format)
        bias = bool(getattr(hf, "medusa_fc_bias", False)) or any(n.endswith(".bias") for n in names)
        own_heads = not bool(getattr(hf, "original_lm_head", False))
        self.model = load_head(
            lambda: MedusaModel(
                hf_config=hf,
                num_heads=num_heads,
                num_layers=num_layers,
                bias=bias,
                own_heads=own_heads,
            ),
            self.spec.model,
            self.dtype,
            self.device,
            self.load_format,
        )

    def propose(self, batch: DraftBatch) -> Proposal:
        idx = batch.sample_idx
        if idx.size == 0:
            return Proposal([])
        rows = batch.row_start[idx] + batch.num_valid[idx] - 1  # [S] last valid row
        hidden = batch.hidden[torch.from_numpy(rows).to(self.device)]  # [S, H]
        features = self.model(hidden.to(self.dtype), self.k)
        heads = self.model.lm_heads
        tokens = [
            ops.argmax(heads[i](f).float() if heads is not None else self.target.compute_logits(f))
            for i, f in enumerate(features)
        ]
        drafts = torch.stack(tokens, dim=1).tolist()  # [S, k]
        limits = draft_limits([batch.states[i] for i in idx.tolist()], self.k)
        return Proposal([row[:n] for row, n in zip(drafts, limits)])
