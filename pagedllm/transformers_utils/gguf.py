"""GGUF checkpoints as model input: a `.gguf` file described as a checkpoint directory.

A GGUF file holds a model's config, its tokenizer (with the chat template) and its weights,
often quantized. pagedllm runs it as vLLM does: the weights are dequantized to the requested
dtype while the model loads, everything else comes from the file. To do that with the code
that reads checkpoint directories, `gguf_checkpoint_dir` turns the file's metadata into a
directory without weights, once per file (cached under `$PAGEDLLM_CACHE_DIR/gguf`, keyed by
the file's path, size and modification time):

- `config.json` and the tokenizer files (`tokenizer.json`, `tokenizer_config.json`, the chat
  template), built by transformers' GGUF conversion;
- `generation_config.json` (the file's BOS / EOS / pad ids);
- `gguf_tensors.json`: where each tensor lies in the file, its ggml type, its shape and the
  Hugging Face parameter name it loads into (`models/gguf_loader.py` reads the weights from it,
  so the engine process never parses the file's metadata again).

Reading a GGUF file's metadata is slow (seconds: the tokenizer is ~100k strings), so the
cached directory makes every load after the first one start as fast as a safetensors one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GGUF_INDEX = "gguf_tensors.json"
COMPLETE_MARKER = ".pagedllm-complete"
# Bumped when the directory's layout changes, so old cached directories are rebuilt.
_FORMAT_VERSION = 1

# general.architecture -> what pagedllm runs it as (mistral files say "llama").
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# ggml tensor types dequantized at load time (by the gguf package).
SUPPORTED_GGUF_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
# llama.cpp's converter interleaves the rotary halves of Llama's q / k rows; loading undoes it.
_PERMUTED_ARCHITECTURES = ("llama",)


def find_gguf_file(model: str) -> Path | None:
    """`model` as a GGUF file: a `.gguf` file, or a directory that holds exactly one `.gguf`
    file and no `config.json`; None for anything else (a checkpoint directory, a missing
    path). A directory with several GGUF files is a ValueError naming them."""
    path = Path(os.path.expanduser(str(model)))
    if path.is_file():
        return path.resolve() if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise ValueError(
            f"model={str(model)!r} holds several GGUF files ({', '.join(p.name for p in found)}); "
            "pass the path of the one to load"
        )
    return found[0].resolve() if found else None


def gguf_cache_root() -> Path:
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or Path.home() / ".cache" / "pagedllm"
    return Path(root) / "gguf"


def gguf_checkpoint_dir(gguf_file: str | Path) -> Path:
    """The cached checkpoint directory (no weights) describing `gguf_file`, written on first
    use. It is built in a temporary sibling and renamed into place, so an interrupted or
    concurrent build never leaves a half-written directory behind."""
    gguf_file = Path(gguf_file).resolve()
    stat = gguf_file.stat()
    key = hashlib.sha256(
        f"{_FORMAT_VERSION}|{gguf_file}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    ).hexdigest()[:16]
    target = gguf_cache_root() / f"{gguf_file.stem}-{key}"
    if (target / COMPLETE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{gguf_file.stem}-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp's 0o700 would stay on the renamed directory
    try:
        write_gguf_checkpoint_dir(gguf_file, tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first (or left an unfinished one)
            if not (target / COMPLETE_MARKER).is_file():
                shutil.rmtree(target, ignore_errors=True)
                tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_gguf_checkpoint_dir(gguf_file: str | Path, out_dir: str | Path) -> None:
    """Write `gguf_file`'s config, tokenizer, generation config and tensor index into
    `out_dir` (see the module docstring), its completion marker last. An architecture or a
    tensor type pagedllm cannot load is a ValueError naming it, raised before the slow
    tokenizer conversion."""
    from gguf import GGUFReader

    gguf_file, out_dir = Path(gguf_file).resolve(), Path(out_dir)
    logger.info("reading GGUF metadata of %s (once; cached afterwards)", gguf_file)
    try:
        reader = GGUFReader(str(gguf_file))
    except (ValueError, OSError) as e:
        raise ValueError(f"{str(gguf_file)!r} is not a readable GGUF file: {e}") from e
    arch = _architecture(reader, gguf_file)
    tensors = _tensor_table(reader, gguf_file)
    del reader

    config = _hf_config(gguf_file)
    if not config.architectures:
        raise ValueError(f"{str(gguf_file)!r}: transformers knows no causal LM for {arch!r}")
    index = {
        "format_version": _FORMAT_VERSION,
        "gguf_file": str(gguf_file),
        "size": gguf_file.stat().st_size,
        "tensors": _with_hf_names(tensors, config, arch, gguf_file),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out_dir))
    _generation_config(config).save_pretrained(str(out_dir))
    _tokenizer(gguf_file).save_pretrained(str(out_dir))
    (out_dir / GGUF_INDEX).write_text(json.dumps(index, indent=1))
    (out_dir / COMPLETE_MARKER).write_text(str(gguf_file))


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _architecture(reader: Any, gguf_file: Path) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF file {str(gguf_file)!r} has architecture {arch!r}, which pagedllm does not "
            f"run; supported GGUF architectures: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    return arch


def _tensor_table(reader: Any, gguf_file: Path) -> list[dict[str, Any]]:
    """Each tensor's name, ggml type name, shape (row-major, as torch sees it), byte offset
    and byte count in the file."""
    table = []
    for t in reader.tensors:
        type_name = t.tensor_type.name
        if type_name not in SUPPORTED_GGUF_TYPES:
            raise ValueError(
                f"GGUF file {str(gguf_file)!r}: tensor {t.name!r} has type {type_name}, which "
                f"pagedllm cannot dequantize; supported types: {', '.join(SUPPORTED_GGUF_TYPES)}"
            )
        table.append(
            {
                "name": t.name,
                "type": type_name,
                "shape": [int(d) for d in reversed(t.shape.tolist())],
                "offset": int(t.data_offset),
                "n_bytes": int(t.n_bytes),
            }
        )
    return table


def _hf_config(gguf_file: Path) -> Any:
    """transformers' config for the file, with `architectures` set (GGUF has no such key)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    config.architectures = [causal_lm] if causal_lm else []
    return config


def _tokenizer(gguf_file: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)


def _generation_config(config: Any) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig.from_model_config(config)


def _with_hf_names(
    tensors: list[dict[str, Any]], config: Any, arch: str, gguf_file: Path
) -> list[dict[str, Any]]:
    """The tensor table with each entry's Hugging Face parameter name (`hf_name`) and, for
    Llama's q / k projections, the head count whose rotary interleaving loading undoes
    (`unpermute_heads`). The names come from gguf's tensor-name map applied to the names of
    transformers' model for the config (built on the meta device: no memory)."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(arch_enum, config.num_hidden_layers)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(config)
    to_hf: dict[str, str] = {}
    for hf_name in hf_model.state_dict():
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = name_map.get_name(base)
        if gguf_name is not None:
            to_hf[f"{gguf_name}.{suffix}"] = hf_name
    unknown = [t["name"] for t in tensors if t["name"] not in to_hf]
    if unknown:
        raise ValueError(
            f"GGUF file {str(gguf_file)!r} has tensors with no {config.architectures[0]} "
            f"parameter: {', '.join(unknown[:5])}"
        )
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for t in tensors:
        t["hf_name"] = to_hf[t["name"]]
        proj = t["hf_name"].split(".")[-2]
        if arch in _PERMUTED_ARCHITECTURES and proj in heads:
            t["unpermute_heads"] = heads[proj]
    return tensors


def is_gguf_checkpoint_dir(model_dir: str | Path) -> bool:
    """Whether `model_dir` is a directory written by `write_gguf_checkpoint_dir` (its
    weights are in the GGUF file its index names)."""
    return (Path(model_dir) / GGUF_INDEX).is_file()
