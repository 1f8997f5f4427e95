"""Load a local checkpoint's tokenizer with transformers (never the network)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from pagedllm.spawn import after_engines_start
from pagedllm.transformers_utils.checkpoint_config import (
    checkpoint_config_from_dict,
    is_light_model_type,
    read_config_json,
)
from pagedllm.transformers_utils.config import resolve_local_dir

T = TypeVar("T")


# tokenizer_config.json's names for transformers' generic fast tokenizer (`TokenizersBackend`;
# PreTrainedTokenizerFast is its older name), and the model types for which AutoTokenizer
# loads a checkpoint naming it as exactly that class: no model-type override of transformers 5
# applies to them (qwen2's table entry does override it, mistral's may pick its own format).
# tests/transformers_utils/test_tokenizer.py checks that both give the same tokenizer.
_GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
_GENERIC_TOKENIZER_MODEL_TYPES = frozenset({"llama"})

# vLLM's tokenizer_mode values that pagedllm serves: "auto" and "hf" (one thing here: there
# is no mistral_common tokenizer to prefer) load the fast tokenizer where there is one,
# "slow" asks transformers for the slow (Python) one, and insists on getting it.
TOKENIZER_MODES = ("auto", "hf", "slow")


def check_tokenizer_mode(mode: str) -> str:
    """`mode`, validated: a ValueError naming it unless it is one of TOKENIZER_MODES."""
    if mode not in TOKENIZER_MODES:
        why = " (pagedllm has no mistral_common tokenizer)" if mode == "mistral" else ""
        raise ValueError(
            f"tokenizer_mode={mode!r} is not supported{why}; choose one of {list(TOKENIZER_MODES)}"
        )
    return mode


def get_tokenizer(
    name: str, trust_remote_code: bool = False, tokenizer_mode: str = "auto", **kwargs: Any
) -> Any:
    """The transformers tokenizer stored in the local directory `name`.

    `tokenizer_mode` (`TOKENIZER_MODES`): "slow" passes `use_fast=False` and refuses (a
    ValueError naming the mode) a fast tokenizer in return: transformers 5 has no slow
    variant of most tokenizers, and its AutoTokenizer ignores `use_fast`.

    Extra keyword arguments go to `AutoTokenizer.from_pretrained`. A checkpoint whose
    tokenizer AutoTokenizer would load as transformers' generic fast tokenizer loads it
    directly: AutoTokenizer's module imports `transformers.models`, whose lazy structure reads
    every model file's `__all__` (~1,700 files; `LLM(...)` is ready ~0.2 s sooner without it,
    BENCHMARKS.md).
    """
    path = resolve_local_dir(name, what="tokenizer")
    if check_tokenizer_mode(tokenizer_mode) == "slow":
        kwargs["use_fast"] = False
        tokenizer = get_tokenizer(name, trust_remote_code, **kwargs)
        if getattr(tokenizer, "is_fast", False):
            raise ValueError(
                f"tokenizer_mode='slow': {str(name)!r} has no slow (Python) tokenizer that "
                f"this transformers loads; it gave the fast {type(tokenizer).__name__}. Use "
                "tokenizer_mode='auto'"
            )
        return tokenizer
    direct = not kwargs  # extra arguments are AutoTokenizer's to read
    configs = None if trust_remote_code or "config" in kwargs else _read_configs(path)
    kwargs.setdefault("local_files_only", True)
    try:
        if direct and configs is not None and _loads_as_generic(path, *configs):
            generic = _generic_tokenizer_class()
            if generic is not None:  # `_from_auto` as AutoTokenizer passes it
                return generic.from_pretrained(str(path), _from_auto=True, **kwargs)
        from transformers import AutoTokenizer

        if configs is not None:
            light = _light_model_config(path, *configs)
            if light is not None:
                kwargs["config"] = light
        return AutoTokenizer.from_pretrained(
            str(path), trust_remote_code=trust_remote_code, **kwargs
        )
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load a tokenizer from {str(name)!r}: {e}") from e


def _generic_tokenizer_class() -> Any:
    """transformers 5's `TokenizersBackend`; None on transformers 4 (AutoTokenizer then)."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    return TokenizersBackend


def _read_configs(path: Path) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(tokenizer_config.json, config.json) of `path`, parsed; None if either is missing or
    not JSON (AutoTokenizer then reads what there is)."""
    try:
        return json.loads((path / "tokenizer_config.json").read_text()), read_config_json(path)
    except (OSError, ValueError):
        return None


def _loads_as_generic(path: Path, tok_config: dict[str, Any], raw: dict[str, Any]) -> bool:
    """Whether AutoTokenizer would load this checkpoint's tokenizer as TokenizersBackend from
    its tokenizer.json, unchanged (see _GENERIC_TOKENIZER_CLASSES)."""
    return (
        tok_config.get("tokenizer_class") in _GENERIC_TOKENIZER_CLASSES
        and "auto_map" not in tok_config
        and raw.get("model_type") in _GENERIC_TOKENIZER_MODEL_TYPES
        and "auto_map" not in raw
        and (path / "tokenizer.json").is_file()
    )


def _light_model_config(path: Path, tok_config: dict[str, Any], raw: dict[str, Any]) -> Any:
    """The checkpoint's config without transformers (a `CheckpointConfig`) when AutoTokenizer
    can be handed it, else None (AutoTokenizer then reads config.json through transformers'
    config classes, whose import costs ~1 s of CPU).

    AutoTokenizer reads a config only for its `model_type` and `tokenizer_class` while
    tokenizer_config.json names the tokenizer class and ships no code of its own; without a
    class name it looks the config's class up in its tables, which only the real one is in.
    """
    if not tok_config.get("tokenizer_class") or "auto_map" in tok_config:
        return None
    if not is_light_model_type(raw):
        return None
    return checkpoint_config_from_dict(raw | {"_name_or_path": str(path)})


def get_tokenizer_while(
    start: Callable[[], T],
    name: str,
    trust_remote_code: bool = False,
    overlap: bool = True,
    tokenizer_mode: str = "auto",
) -> tuple[Any, T]:
    """(the tokenizer of `name`, `start()`), the tokenizer loaded on a thread while `start`
    runs: starting an engine is mostly waiting for its process, and transformers' import and
    the tokenizer's files take 1-2 s of CPU the front end would otherwise spend first. If the
    tokenizer fails to load, `start()`'s result is shut down (`.shutdown()`) before the error
    is raised. `overlap=False` loads it first, on this thread: for a `start` that imports
    transformers itself (an engine core built in this process), since two threads importing
    transformers' lazy modules at once can see them half-initialised. `tokenizer_mode`: as
    `get_tokenizer`'s."""
    load_tokenizer = functools.partial(
        get_tokenizer, name, trust_remote_code=trust_remote_code, tokenizer_mode=tokenizer_mode
    )
    if not overlap:
        tokenizer = load_tokenizer()
        return tokenizer, start()
    with ThreadPoolExecutor(1, thread_name_prefix="TokenizerLoad") as pool:
        futures: list[Future] = []

        def load() -> None:
            if not futures:
                futures.append(pool.submit(load_tokenizer))

        # The load's thread starts once the engine processes have (a fork must not copy it
        # mid-import), or after `start()` when it launched none.
        with after_engines_start(load):
            started = start()
        load()
        try:
            return futures[0].result(), started
        except BaseException:
            started.shutdown()  # type: ignore[attr-defined]
            raise
