"""Tensor-parallel linear layers that create only their own shard of the weight.

Column parallel layers split the output features over the tensor-parallel ranks (each rank
computes a slice of the outputs, no communication); row parallel layers split the input
features (each rank computes a partial sum, then an all-reduce). A Megatron-style MLP or
attention block is a column layer followed by a row layer, one all-reduce per block.

Every parameter carries `weight_loader(param, loaded_weight, shard_id=None)`: it receives the
whole checkpoint tensor and copies this rank's slice into the parameter. Merged layers
(gate/up, q/k/v) take one checkpoint tensor per `shard_id` and place it at its offset, so the
same loading code serves a sharded layer and a whole one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pagedllm.distributed import get_tp_rank, get_tp_world_size, tp_all_gather, tp_all_reduce
from pagedllm.layers.cpu_gemm import pack_linear_weight_, packed_linear


def set_weight_loader(param: nn.Parameter, loader) -> None:
    """Attach `loader(param, loaded_weight, shard_id=None)` to a parameter."""
    param.weight_loader = loader


def default_weight_loader(
    param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
) -> None:
    """Copy a whole (unsharded) tensor into `param`, converting dtype and device."""
    _checked_copy(param.data, loaded_weight)


def _checked_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(src.shape)} does not fit parameter (slice) of "
            f"shape {tuple(dst.shape)}"
        )
    dst.copy_(src)


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(
            f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}"
        )
    return numerator // denominator


class LinearBase(nn.Module):
    """A linear layer over this rank's weight shard
    [output_size_per_partition, input_size_per_partition] (and bias shard, if any)."""

    cpu_gemm: str | None = None  # the CPU kernel its packed weight is for (layers/cpu_gemm.py)
    batch_invariant = False  # set by make_batch_invariant_

    def __init__(
        self,
        input_size_per_partition: int,
        output_size_per_partition: int,
        bias: bool,
        params_dtype: torch.dtype | None,
        prefix: str,
    ) -> None:
        super().__init__()
        self.prefix = prefix
        self.tp_size = get_tp_world_size()
        self.tp_rank = get_tp_rank()
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(
            torch.empty(output_size_per_partition, input_size_per_partition, dtype=dtype),
            requires_grad=False,
        )
        set_weight_loader(self.weight, self.weight_loader)
        if bias:
            self.bias = nn.Parameter(
                torch.empty(output_size_per_partition, dtype=dtype), requires_grad=False
            )
            set_weight_loader(self.bias, self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self) -> None:
        """Called once by the loader after every weight is in place."""
        pack_linear_weight_(self)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return packed_linear(self, x, bias)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(input_size, output_size, bias, params_dtype, prefix)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """y = x W^T + b with W split along its output rows: rank r holds rows
    `[r * out/tp, (r + 1) * out/tp)`. Output is this rank's slice unless `gather_output`."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        gather_output: bool = False,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
    ) -> None:
        tp = get_tp_world_size()
        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output
        super().__init__(
            input_size, _divide(output_size, tp, "output_size"), bias, params_dtype, prefix
        )

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        # weight [out, in] and bias [out] are both split along dim 0.
        size = param.shape[0]
        _checked_copy(param.data, loaded_weight.narrow(0, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._linear(x, self.bias)  # [T, out / tp]
        return tp_all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers over the same input, fused into one GEMM (gate/up).

    Shard `i` of the checkpoint (`shard_id=i`, of `output_sizes[i]` rows) lands at rows
    `sum(output_sizes[:i]) / tp ...` of the local weight, this rank's slice of it.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        gather_output: bool = False,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
    ) -> None:
        self.output_sizes = list(output_sizes)
        tp = get_tp_world_size()
        for size in self.output_sizes:
            _divide(size, tp, "output_size")
        super().__init__(input_size, sum(output_sizes), bias, gather_output, params_dtype, prefix)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if shard_id is None:
            # A checkpoint that already stores the fused tensor.
            super().weight_loader(param, loaded_weight)
            return
        shard_id = int(shard_id)
        tp = self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // tp
        size = self.output_sizes[shard_id] // tp
        dst = param.data.narrow(0, offset, size)
        _checked_copy(dst, loaded_weight.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections fused into one column-parallel GEMM, with grouped-query
    attention: local output = [q heads of this rank | k heads | v heads], each head `head_size`.

    With more ranks than kv heads, each kv head is replicated on `tp / total_num_kv_heads`
    consecutive ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
    ) -> None:
        tp = get_tp_world_size()
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = _divide(total_num_heads, tp, "num_attention_heads")
        if tp >= total_num_kv_heads:
            _divide(tp, total_num_kv_heads, "num_key_value_heads (as divisor)")
            self.num_kv_heads = 1
            self.num_kv_head_replicas = tp // total_num_kv_heads
        else:
            self.num_kv_heads = _divide(total_num_kv_heads, tp, "num_key_value_heads")
            self.num_kv_head_replicas = 1
        self.q_size = self.num_heads * head_size  # local
        self.kv_size = self.num_kv_heads * head_size  # local
        output_size = (self.num_heads + 2 * self.num_kv_heads) * tp * head_size
        super().__init__(hidden_size, output_size, bias, False, params_dtype, prefix)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if shard_id is None:
            raise ValueError(
                f"{self.prefix}: a fused qkv checkpoint tensor is not supported; "
                "expected separate q_proj / k_proj / v_proj"
            )
        if shard_id == "q":
            offset, size, shard_rank = 0, self.q_size, self.tp_rank
        elif shard_id == "k":
            offset, size = self.q_size, self.kv_size
            shard_rank = self.tp_rank // self.num_kv_head_replicas
        elif shard_id == "v":
            offset, size = self.q_size + self.kv_size, self.kv_size
            shard_rank = self.tp_rank // self.num_kv_head_replicas
        else:
            raise ValueError(f"shard_id={shard_id!r} must be 'q', 'k' or 'v'")
        dst = param.data.narrow(0, offset, size)
        _checked_copy(dst, loaded_weight.narrow(0, shard_rank * size, size))


class RowParallelLinear(LinearBase):
    """y = x W^T + b with W split along its input columns: rank r holds columns
    `[r * in/tp, (r + 1) * in/tp)` and takes the matching slice of x (the output of a column
    parallel layer). Partial sums are all-reduced when `reduce_results`; the bias is added once.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        reduce_results: bool = True,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
    ) -> None:
        tp = get_tp_world_size()
        self.input_size = input_size
        self.output_size = output_size
        self.reduce_results = reduce_results
        super().__init__(
            _divide(input_size, tp, "input_size"), output_size, bias, params_dtype, prefix
        )

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if param.dim() == 1:  # bias: whole on every rank
            _checked_copy(param.data, loaded_weight)
            return
        size = param.shape[1]
        _checked_copy(param.data, loaded_weight.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, in / tp] -> [T, out]
        bias = self.bias if self.tp_rank == 0 else None
        y = self._linear(x, bias)
        if self.reduce_results and self.tp_size > 1:
            y = tp_all_reduce(y)
        return y
