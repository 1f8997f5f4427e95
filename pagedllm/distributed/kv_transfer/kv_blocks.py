"""Whole KV blocks out of and into the engine's paged KV-cache tensors, whatever their layout.

Connectors move blocks, never tokens: block b of one layer is `kv_cache.select(block_dim, b)`,
and `block_dim` is found from the attention backend's `get_kv_cache_shape` (the axis that
grows with the number of blocks), so a backend may lay keys, values, heads and tokens out as it
likes. Every layer must have the same block shape and dtype (true of every model here), so a
block's bytes over all layers form one `[num_layers, block_numel]` array: the unit that tiers
store and the network sends. Blocks move as they are stored, an fp8 cache's (`kv_cache_dtype`)
byte for byte, never converted.

`kv_cache_fingerprint` names what stored blocks are only valid for (the weights, the model and
KV dtypes and the block size): stores on disk keep their files in a directory of that name, so
a restart with another model never reads blocks of the old one; `claim_layout` makes sure the
blocks in such a directory are laid out as this engine's are.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedllm.attention.fp8_kv import storage_view

if TYPE_CHECKING:
    from pagedllm.attention.backend import AttentionBackend
    from pagedllm.config import EngineConfig

# Bytes read from each end of a weights file for the fingerprint (hashing whole multi-GB
# checkpoints at every start would cost seconds; the ends hold headers and distinct weights).
_FINGERPRINT_SAMPLE_BYTES = 1 << 20


def kv_block_dim(backend: AttentionBackend) -> int:
    """The axis of `backend`'s KV-cache tensors that indexes blocks."""
    one = backend.get_kv_cache_shape(1, 16, 1, 8)
    two = backend.get_kv_cache_shape(2, 16, 1, 8)
    dims = [i for i, (a, b) in enumerate(zip(one, two)) if a != b]
    if len(dims) != 1:
        raise ValueError(f"cannot find the block axis of {backend.name}'s KV-cache layout")
    return dims[0]


class PagedKVBlocks:
    """The worker's KV-cache tensors (one per attention layer, in model order) seen as blocks.

    `gather(layer, ids)` copies whole blocks out as `[n, *block_shape]`; `scatter(layer, ids,
    data)` writes them in. Both are safe to call from a background thread while the model
    runs, as long as no one else reads or writes the same blocks (the scheduler guarantees
    that: blocks in transfer belong to no running request).
    """

    def __init__(
        self,
        kv_caches: dict[str, torch.Tensor],
        block_dim: int,
        kv_scales: dict[str, tuple[float, float]] | None = None,
    ) -> None:
        if not kv_caches:
            raise ValueError("a KV connector needs at least one attention layer")
        self.layer_names = list(kv_caches)
        # An fp8 cache's blocks mean their values only with these scales (a peer must share
        # them); None where every layer's are 1.0.
        scales = [list(kv_scales.get(n, (1.0, 1.0))) for n in self.layer_names] if kv_scales else []
        self.kv_scales = scales if any(s != [1.0, 1.0] for s in scales) else None
        self.layer_index = {name: i for i, name in enumerate(self.layer_names)}
        # Views with blocks first: [num_blocks, *block_shape], writes go to the caches.
        self._views = [kv.movedim(block_dim, 0) for kv in kv_caches.values()]
        shapes = {(tuple(v.shape[1:]), v.dtype) for v in self._views}
        if len(shapes) != 1:
            raise ValueError(
                f"KV connectors need one block shape and dtype for all layers, got {shapes}"
            )
        self.num_blocks = self._views[0].shape[0]
        self.block_shape = tuple(self._views[0].shape[1:])
        self.dtype = self._views[0].dtype
        self.device = self._views[0].device
        self.block_numel = int(np.prod(self.block_shape))

    @property
    def num_layers(self) -> int:
        return len(self._views)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over all layers."""
        return self.num_layers * self.block_numel * self.dtype.itemsize

    def _ids(self, block_ids: list[int] | torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(block_ids, dtype=torch.long, device=self.device)

    def gather(self, layer: int, block_ids: list[int] | torch.Tensor) -> torch.Tensor:
        """Blocks `block_ids` of layer `layer` (an index), a new `[n, *block_shape]` tensor."""
        return self._views[layer].index_select(0, self._ids(block_ids))

    def scatter(self, layer: int, block_ids: list[int] | torch.Tensor, data: torch.Tensor) -> None:
        """Write `data` (`n` blocks of `block_numel` elements, any device) into blocks
        `block_ids` of layer `layer`."""
        src = data.to(self.device, self.dtype).reshape(len(block_ids), *self.block_shape)
        storage_view(self._views[layer]).index_copy_(0, self._ids(block_ids), storage_view(src))

    def describe(self) -> dict[str, Any]:
        """The layout a peer must share to exchange blocks with this engine."""
        layout = {
            "num_layers": self.num_layers,
            "block_shape": list(self.block_shape),
            "dtype": str(self.dtype).removeprefix("torch."),
        }
        if self.kv_scales is not None:  # (only then: layouts with unit scales stay as they were)
            layout["kv_scales"] = self.kv_scales
        return layout


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor (contiguous first): zero-copy for sockets and files."""
    t = tensor.detach().contiguous()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def tensor_from_bytes(data: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over `data` (a bytes-like object of exactly the right size), no copy."""
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(memoryview(data).cast("B")) != expected:
        raise ValueError(f"expected {expected} bytes of KV, got {len(memoryview(data))}")
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).view(shape)


def kv_cache_fingerprint(config: EngineConfig) -> str:
    """A short hex id of what KV blocks depend on besides their tokens: the model's config
    and weights (sampled: size plus the first and last MiB of every weights file; dummy
    weights: their seed), the model's dtype (K/V computed in it), the KV cache's dtype, the
    block size and, with calculate_kv_scales, what its calibration depends on besides those
    (the seed and the calibration prompt's length: worker/kv_scales.py).
    The same in every process that loads the same checkpoint."""
    mc = config.model_config
    h = hashlib.sha256()
    hf = mc.hf_config.to_dict() if hasattr(mc.hf_config, "to_dict") else vars(mc.hf_config)
    h.update(json.dumps(hf, sort_keys=True, default=str).encode())
    layout = [str(mc.dtype), config.cache_config.block_size]
    if config.kv_cache_torch_dtype != mc.dtype:  # only then: a cache in the model's dtype
        layout.append(str(config.kv_cache_torch_dtype))  # keeps the id it had before fp8
    if config.cache_config.calculate_kv_scales:  # fp8 scales from a seeded calibration
        from pagedllm.worker.kv_scales import calibration_tokens

        layout += ["calculate_kv_scales", mc.seed, calibration_tokens(config)]
    h.update(json.dumps(layout).encode())
    if config.load_config.load_format == "dummy":
        h.update(f"dummy weights, seed {mc.seed}".encode())
    model_dir = mc.model
    if os.path.isdir(model_dir):
        for name in sorted(os.listdir(model_dir)):
            # gguf_tensors.json: a GGUF checkpoint's weights are in the file its index names.
            if not name.endswith((".safetensors", ".bin", ".pt", "gguf_tensors.json")):
                continue
            path = os.path.join(model_dir, name)
            size = os.path.getsize(path)
            h.update(f"{name}:{size}".encode())
            with open(path, "rb") as f:
                h.update(f.read(_FINGERPRINT_SAMPLE_BYTES))
                if size > 2 * _FINGERPRINT_SAMPLE_BYTES:
                    f.seek(-_FINGERPRINT_SAMPLE_BYTES, os.SEEK_END)
                    h.update(f.read())
    return h.hexdigest()[:16]


def claim_layout(directory: str, layout: dict[str, Any]) -> None:
    """Create `directory` for blocks of `layout`, or check that the blocks already in it have
    that layout (ValueError otherwise: an engine with another attention backend or tensor
    parallel split must use another directory)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "layout.json")
    try:
        with open(path, encoding="utf-8") as f:
            stored = json.load(f)
    except FileNotFoundError:
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(layout, f)
        os.replace(tmp, path)
        return
    if stored != json.loads(json.dumps(layout)):
        raise ValueError(
            f"{directory} holds KV blocks laid out as {stored}, but this engine's are {layout}; "
            "use another path"
        )
