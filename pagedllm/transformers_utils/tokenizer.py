"""Load a local checkpoint's tokenizer with transformers (never the network)."""

from __future__ import annotations

from typing import Any

from pagedllm.transformers_utils.config import resolve_local_dir


def get_tokenizer(name: str, trust_remote_code: bool = False, **kwargs: Any) -> Any:
    """The transformers tokenizer stored in the local directory `name`.

    Extra keyword arguments go to `AutoTokenizer.from_pretrained`.
    """
    from transformers import AutoTokenizer

    path = resolve_local_dir(name, what="tokenizer")
    kwargs.setdefault("local_files_only", True)
    try:
        return AutoTokenizer.from_pretrained(
            str(path), trust_remote_code=trust_remote_code, **kwargs
        )
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load a tokenizer from {str(name)!r}: {e}") from e
