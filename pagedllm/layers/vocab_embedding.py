"""Token embedding and LM head, split over tensor-parallel ranks along the vocabulary.

Rank r owns token ids `[r * V_p, (r + 1) * V_p)` with `V_p = ceil(vocab / tp)`; the last
rank's table is padded past the real vocabulary (padding rows stay zero and their logits are
trimmed off). With tied embeddings the LM head *is* the embedding module (one parameter).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import get_tp_rank, get_tp_world_size, tp_all_reduce
from pagedllm.layers.cpu_gemm import pack_linear_weight_
from pagedllm.layers.linear import set_weight_loader
from pagedllm.layers.quantization import quantize_rows


class VocabParallelEmbedding(nn.Module):
    """Embedding table [V_p, embedding_dim] holding this rank's slice of the vocabulary.

    `tied_lm_head` (set by a model whose LM head is this table): after loading, the table
    keeps its plain rows for the lookups and gets a copy laid out for the logits GEMM: an int8
    one if `quantize_logits` (set by `quantize_model_`) and this CPU runs the int8 kernel.
    """

    tied_lm_head = False
    quantize_logits = False
    cpu_gemm: str | None = None  # as LinearBase's: the logits' kernel (layers/cpu_gemm.py)
    batch_invariant = False

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.prefix = prefix
        self.tp_size = get_tp_world_size()
        self.tp_rank = get_tp_rank()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=dtype),
            requires_grad=False,
        )
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if loaded_weight.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"{self.prefix}: checkpoint tensor of shape {tuple(loaded_weight.shape)} does not "
                f"match vocab_size x hidden = ({self.num_embeddings}, {self.embedding_dim})"
            )
        self._copy_vocab_rows(param, loaded_weight)

    def _copy_vocab_rows(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """This rank's vocabulary rows of a full-vocabulary tensor; padding rows zeroed."""
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(loaded_weight[self.vocab_start : self.vocab_end])
        param.data[rows:].zero_()

    def process_weights_after_loading(self) -> None:
        """Called once by the loader."""
        if not self.tied_lm_head:
            return
        if self.quantize_logits:  # an int8 copy for the logits, where the int8 kernel runs
            q, scale = quantize_rows(self.weight.data)
            if pack_linear_weight_(self, keep_plain=True, weight=q):
                self.register_buffer("weight_scale", scale, persistent=False)
                return
        pack_linear_weight_(self, keep_plain=True)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids [T] -> [T, embedding_dim]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        ids = torch.where(local, input_ids - self.vocab_start, 0)
        out = F.embedding(ids, self.weight) * local.unsqueeze(-1).to(self.weight.dtype)
        return tp_all_reduce(out)

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
            f"per_partition={self.num_embeddings_per_partition}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection hidden -> vocabulary logits, same sharding as the embedding.

    It is not called directly: `LogitsProcessor` multiplies hidden states by its `weight`
    (and `bias`) and gathers the vocabulary slices.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, params_dtype, prefix)
        if bias:
            self.bias = nn.Parameter(
                torch.empty(self.num_embeddings_per_partition, dtype=self.weight.dtype),
                requires_grad=False,
            )
            set_weight_loader(self.bias, lambda p, w, shard_id=None: self._copy_vocab_rows(p, w))
        else:
            self.register_parameter("bias", None)

    def process_weights_after_loading(self) -> None:
        """Called once by the loader. An untied head is only ever multiplied, so its weight
        may be packed for the CPU GEMM; a tied one is the embedding table and never is."""
        pack_linear_weight_(self)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied through LogitsProcessor, not called")
