"""Llama-family decoder (Llama 2/3/3.x, Mistral), parametrised for its close relatives.

A pre-norm decoder: embed -> N x [RMSNorm -> attention (GQA, RoPE) -> add -> RMSNorm ->
SwiGLU MLP -> add] -> RMSNorm -> LM head. The residual add is fused into the next norm. The
variants differ only in where biases sit and whether q/k are RMS-normed per head
(`LlamaLayerSpec`); Qwen2 and Qwen3 subclass `LlamaForCausalLM` and override `layer_spec`.

All tokens of a step are one flattened sequence [T]; `attn_metadata` (built by the attention
backend) tells each attention layer which request every row belongs to.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.attention.layer import Attention
from pagedllm.config import EngineConfig
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.cpu_fused import FusedLayer, FusedStack, layer_plan, stack_plan
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from pagedllm.layers.logits_processor import LogitsProcessor
from pagedllm.layers.rotary_embedding import (
    RotaryEmbedding,
    get_rope,
    rope_parameters_from_config,
)
from pagedllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.models.pipeline import (
    IntermediateTensors,
    PPMissingLayer,
    get_pp_stage,
    make_layers,
    missing_prefixes,
)


@dataclass(frozen=True)
class LlamaLayerSpec:
    """What distinguishes the members of the family inside a decoder layer."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def get_head_dim(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )


def check_sliding_window(hf_config: Any, max_model_len: int) -> None:
    """Sliding-window attention is not implemented; it is harmless only while no sequence can
    be longer than the window."""
    uses = getattr(hf_config, "use_sliding_window", None)
    window = getattr(hf_config, "sliding_window", None)
    if uses is None:
        uses = window is not None
    if uses and window is not None and max_model_len > window:
        raise ValueError(
            f"this checkpoint uses sliding-window attention (sliding_window={window}), which "
            f"pagedllm does not implement; set max_model_len <= {window} (got {max_model_len})"
        )


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one column-parallel GEMM."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        bias: bool = False,
        prefix: str = "",
    ) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act={hidden_act!r} is not supported; only 'silu' is")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, prefix=_join(prefix, "gate_up_proj")
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, prefix=_join(prefix, "down_proj")
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * I / tp]
        return self.down_proj(self.act_fn(gate_up))  # [T, hidden]


class LlamaAttention(nn.Module):
    """Self-attention: fused qkv projection, optional per-head q/k norm, RoPE, paged attention,
    output projection."""

    def __init__(
        self,
        hf_config: Any,
        spec: LlamaLayerSpec,
        rotary_emb: RotaryEmbedding,
        prefix: str = "",
    ) -> None:
        super().__init__()
        hidden_size = hf_config.hidden_size
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        self.head_dim = get_head_dim(hf_config)
        self.qkv_proj = QKVParallelLinear(
            hidden_size,
            self.head_dim,
            num_heads,
            num_kv_heads,
            bias=spec.qkv_bias,
            prefix=_join(prefix, "qkv_proj"),
        )
        self.o_proj = RowParallelLinear(
            num_heads * self.head_dim, hidden_size, bias=spec.o_bias, prefix=_join(prefix, "o_proj")
        )
        self.q_size = self.qkv_proj.q_size  # local to this rank
        self.kv_size = self.qkv_proj.kv_size
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=hf_config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=hf_config.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.qkv_proj.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.qkv_proj.num_kv_heads,
            prefix=_join(prefix, "attn"),
        )

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, attn_metadata: Any
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:  # each head a row: the norms' native row kernel takes 2-D rows
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(num_tokens, self.q_size)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(num_tokens, self.kv_size)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v.contiguous(), attn_metadata)  # [T, H * D]
        return self.o_proj(out)  # [T, hidden]


class LlamaDecoderLayer(nn.Module):
    """One pre-norm block; takes and returns the (hidden, residual) pair of the fused adds."""

    def __init__(
        self,
        hf_config: Any,
        spec: LlamaLayerSpec,
        rotary_emb: RotaryEmbedding,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(hf_config, spec, rotary_emb, _join(prefix, "self_attn"))
        self.mlp = LlamaMLP(
            hf_config.hidden_size,
            hf_config.intermediate_size,
            hf_config.hidden_act,
            bias=spec.mlp_bias,
            prefix=_join(prefix, "mlp"),
        )
        eps = hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps=eps)
        # The fused CPU ops' arguments (layers/cpu_fused.py): None until the first forward,
        # then a FusedLayer, or False where they do not apply.
        self._fused: FusedLayer | bool | None = None

    def fused_plan(self) -> FusedLayer | None:
        """The layer's fused CPU ops plan, decided at the first call (a forward's, when the
        weights are packed); None where they do not apply."""
        if self._fused is None:
            self._fused = layer_plan(self) or False
        return self._fused or None

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden_states: torch.Tensor,  # [T, hidden]
        residual: torch.Tensor | None,  # [T, hidden] or None for the first layer
        attn_metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not torch.compiler.is_compiling():  # (Inductor fuses the traced modules instead)
            fused = self.fused_plan()
            if fused and hidden_states.dtype == fused.dtype and hidden_states.dim() == 2:
                return fused.forward(self, positions, hidden_states, residual, attn_metadata)
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (the checkpoint's `model.` subtree). A
    pipeline stage builds only its share (models/pipeline.py); the others are placeholders."""

    def __init__(self, *, config: EngineConfig, spec: LlamaLayerSpec, prefix: str = "") -> None:
        super().__init__()
        hf_config = config.model_config.hf_config
        check_sliding_window(hf_config, config.model_config.max_model_len)
        self.stage = get_pp_stage(
            hf_config.num_hidden_layers, config.parallel_config.pp_layer_partition
        )
        self.embed_tokens = (
            VocabParallelEmbedding(
                hf_config.vocab_size, hf_config.hidden_size, prefix=_join(prefix, "embed_tokens")
            )
            if self.stage.is_first
            else PPMissingLayer()
        )
        head_dim = get_head_dim(hf_config)
        theta, rope_params = rope_parameters_from_config(hf_config)
        partial = (rope_params or {}).get("partial_rotary_factor", 1.0)
        max_pos = hf_config.max_position_embeddings
        # One cos/sin table shared by every layer, long enough for any position served.
        self.rotary_emb = get_rope(
            head_dim,
            int(head_dim * partial),
            max_pos,
            theta,
            rope_params,
            cache_len=max(max_pos, config.model_config.max_model_len),
        )
        self.layers = make_layers(
            hf_config.num_hidden_layers,
            self.stage,
            lambda i: LlamaDecoderLayer(
                hf_config, spec, self.rotary_emb, _join(prefix, f"layers.{i}")
            ),
        )
        self.norm = (
            RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)
            if self.stage.is_last
            else PPMissingLayer()
        )
        # The stage's layers in one native call on decode-only CPU steps (layers/cpu_fused.py):
        # None until the first forward, then a FusedStack, or False where it does not apply.
        self._fused_stack: FusedStack | bool | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: Any,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if self.stage.is_first:
            hidden_states, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        else:  # a later pipeline stage continues from the previous one's activations
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        # islice: a ModuleList slice builds a new ModuleList (a module registration a layer).
        stage_layers = itertools.islice(self.layers, self.stage.start, self.stage.end)
        stacked = None
        if not torch.compiler.is_compiling():
            if self._fused_stack is None:  # decided at the first forward (weights packed)
                stage_layers = list(stage_layers)
                self._fused_stack = stack_plan(stage_layers) or False
            if self._fused_stack:
                stacked = self._fused_stack.forward(
                    positions, hidden_states, residual, attn_metadata
                )
        if stacked is not None:
            hidden_states, residual = stacked
        else:
            for layer in stage_layers:
                hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        if not self.stage.is_last:
            return IntermediateTensors(hidden_states=hidden_states, residual=residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states  # [T, hidden]


_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


def _layer_index(name: str) -> int:
    """The decoder layer a checkpoint tensor belongs to (-1: none)."""
    match = _LAYER_NAME.match(name)
    return int(match.group(1)) if match else -1


class LlamaForCausalLM(nn.Module):
    """Llama decoder with an LM head; the template every supported architecture follows.

    Checkpoint names map onto parameters one to one except for the fused projections listed in
    `packed_modules_mapping`; `load_weights` routes each checkpoint tensor to its parameter's
    `weight_loader` (which takes this tensor-parallel rank's slice).
    """

    packed_modules_mapping: dict[str, list[str]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    # shard_id each packed source name passes to the fused parameter's weight_loader.
    _shard_ids: dict[str, object] = {
        "q_proj": "q",
        "k_proj": "k",
        "v_proj": "v",
        "gate_proj": 0,
        "up_proj": 1,
    }

    @classmethod
    def layer_spec(cls, hf_config: Any) -> LlamaLayerSpec:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return LlamaLayerSpec(
            qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(hf_config, "mlp_bias", False))
        )

    def __init__(self, *, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        hf_config = config.model_config.hf_config
        self.config = config
        self.model = LlamaModel(
            config=config, spec=self.layer_spec(hf_config), prefix=_join(prefix, "model")
        )
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        stage = self.model.stage
        if not stage.is_last:
            self.lm_head = PPMissingLayer()
        elif self.tie_word_embeddings and stage.is_first:
            self.lm_head = self.model.embed_tokens
            self.lm_head.tied_lm_head = True
        else:  # untied, or tied with the embedding on another stage: loaded from its tensor
            self.lm_head = ParallelLMHead(
                hf_config.vocab_size, hf_config.hidden_size, prefix=_join(prefix, "lm_head")
            )
        self.logits_processor = LogitsProcessor(hf_config.vocab_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: Any,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """input_ids [T], positions [T] -> hidden states [T, hidden]; a pipeline stage before
        the last returns its `IntermediateTensors` instead (and a later one takes them)."""
        return self.model(input_ids, positions, attn_metadata, intermediate_tensors)

    def make_empty_intermediate_tensors(
        self, num_tokens: int, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors:
        """Buffers for the activations this stage receives from the previous one."""
        hidden = self.config.model_config.hidden_size
        return IntermediateTensors(
            hidden_states=torch.empty(num_tokens, hidden, dtype=dtype, device=device),
            residual=torch.empty(num_tokens, hidden, dtype=dtype, device=device),
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """hidden_states [N, hidden] -> float32 logits [N, vocab_size] (None on the
        tensor-parallel ranks other than the first, which sample nothing)."""
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load (checkpoint name, tensor) pairs; returns the parameter names that received
        data. Unknown checkpoint names raise, except RoPE buffers, a tied LM head and decoder
        layers past the model's last (a model cut short by `hf_overrides={"num_hidden_layers":
        n}` leaves the checkpoint's later layers unread, as transformers does)."""
        params = dict(self.named_parameters())
        packed = {src: fused for fused, srcs in self.packed_modules_mapping.items() for src in srcs}
        other_stages = missing_prefixes(self)
        num_layers = len(self.model.layers)
        # Tied, with the embedding on another pipeline stage: the head loads its tensor.
        embed_into_head = self.tie_word_embeddings and isinstance(self.lm_head, ParallelLMHead)
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name:
                continue
            if self.tie_word_embeddings and name.startswith("lm_head."):
                continue  # some tied checkpoints still store the shared matrix twice
            if embed_into_head and name == "model.embed_tokens.weight":
                self.lm_head.weight_loader(self.lm_head.weight, tensor)
                loaded.add("lm_head.weight")
            if name.startswith(other_stages) or _layer_index(name) >= num_layers:
                continue
            param_name, shard_id = name, None
            parts = name.split(".")
            for i, part in enumerate(parts):
                if part in packed:
                    parts[i] = packed[part]
                    param_name, shard_id = ".".join(parts), self._shard_ids[part]
                    break
            param = params.get(param_name)
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} matches no parameter of "
                    f"{type(self).__name__} (looked for {param_name!r})"
                )
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"while loading {name!r} into {param_name!r}: {e}") from e
            loaded.add(param_name)
        return loaded


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral checkpoints: the Llama architecture (sliding window checked at build time)."""
