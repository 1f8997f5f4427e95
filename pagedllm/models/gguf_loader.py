"""Weights of a GGUF file, dequantized tensor by tensor, under Hugging Face parameter names.

The checkpoint directory `transformers_utils/gguf.py` wrote for the file holds its tensor
index (`gguf_tensors.json`: offset, byte count, ggml type, shape, parameter name), so this
reads no metadata: it maps the file, takes each tensor's bytes and dequantizes them with the
gguf package to float32; the parameters' weight loaders then cast to the model's dtype.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from pagedllm.transformers_utils.gguf import GGUF_INDEX


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of a Llama q / k projection: per head it stores the rows
    of the two rotary halves interleaved ([x0, y0, x1, y1, ...]); Hugging Face's rotary
    embedding wants them in halves ([x0, x1, ..., y0, y1, ...]). weight: [rows, cols]."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape_as(weight)


def iterate_gguf_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, float32 CPU tensor) for each tensor of the GGUF file that
    `model_dir`'s index describes."""
    from gguf import GGMLQuantizationType, dequantize

    index = json.loads((Path(model_dir) / GGUF_INDEX).read_text())
    path = Path(index["gguf_file"])
    if not path.is_file() or path.stat().st_size != index["size"]:
        raise ValueError(
            f"the GGUF file {str(path)!r} indexed in {str(model_dir)!r} is gone or has changed; "
            "load the .gguf file again (its index is rebuilt)"
        )
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for t in index["tensors"]:
        shape = t["shape"]
        raw = data[t["offset"] : t["offset"] + t["n_bytes"]]
        # gguf's dequantize takes rows of bytes and returns float32 rows of `shape[-1]`.
        raw = raw.reshape(*shape[:-1], -1)
        values = dequantize(raw, GGMLQuantizationType[t["type"]]).reshape(shape)
        if not values.flags.writeable:  # F32 data is a view of the (read-only) mapped file
            values = values.copy()
        tensor = torch.from_numpy(values)
        if "unpermute_heads" in t:
            tensor = unpermute_rotary_rows(tensor, t["unpermute_heads"])
        yield t["hf_name"], tensor
