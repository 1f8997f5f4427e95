"""Build small random-weight Hugging Face checkpoints, with a tokenizer, entirely offline.

`make_demo_model(DIR, preset="tiny")` writes what a real checkpoint directory holds:
config.json, model.safetensors (or shards plus index), generation_config.json, and a
byte-level BPE tokenizer (tokenizer.json, tokenizer_config.json, chat template) trained in
process on a small built-in English corpus. The weights are seeded and scaled so that the
logits have a spread of a few units (greedy decoding is not decided by rounding noise).

Presets: `tiny` (tests), `demo` (the built-in model `make serve` uses), `llama-125m`
(CPU benchmarks), `llama-1b` (GPU benchmarks). Any transformers config field can be
overridden by keyword.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=512,
    ),
    "demo": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=768,
        vocab_size=4096,
        max_position_embeddings=2048,
    ),
    "llama-125m": dict(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
        vocab_size=32000,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    # Llama-3.2-1B's shape (1.24B parameters): the GPU benchmarks' model.
    "llama-1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
}

# architecture -> (transformers config class, defaults that make the family recognisable)
_ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "LlamaForCausalLM": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "MistralForCausalLM": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None)),
    "Qwen2ForCausalLM": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "Qwen3ForCausalLM": ("Qwen3Config", dict(tie_word_embeddings=False)),
}

# Tiny-checkpoint variants tests use, one per architecture, each exercising what sets that
# architecture apart: make_demo_model(dir, preset="tiny", **TINY_ARCH_OVERRIDES["qwen3"]).
TINY_ARCH_OVERRIDES: dict[str, dict[str, Any]] = {
    # GQA (4 query heads, 2 kv heads) and Llama-3 rope scaling.
    "llama": dict(
        architecture="LlamaForCausalLM",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": dict(architecture="MistralForCausalLM"),
    # q/k/v biases and tied embeddings.
    "qwen2": dict(architecture="Qwen2ForCausalLM", tie_word_embeddings=True),
    # Per-head q/k norm; head_dim 32 differs from hidden 64 / 4 heads.
    "qwen3": dict(architecture="Qwen3ForCausalLM", head_dim=32),
}

SPECIAL_TOKENS = [
    "<unk>",
    "<s>",
    "</s>",
    "<pad>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
]
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
END_OF_TURN_ID = SPECIAL_TOKENS.index("<|end|>")

# Each message as <|role|>\ncontent<|end|>\n after one BOS; the reply opens with <|assistant|>.
# Hermes-style tool use (as Qwen's templates render it): `tools` become a system block of
# <tools> JSON lines; an assistant message's `tool_calls` follow its content, one
# <tool_call>{"name": ..., "arguments": ...}</tool_call> each; a tool result is a `tool`
# message. `enable_thinking=False` (a chat_template_kwargs entry) closes an empty think block
# in the prompt, as Qwen3's template does, so the reply starts after the reasoning.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|system|>\\n# Tools\\n<tools>\\n' }}"
    "{% for tool in tools %}{{ (tool.function if tool.function is defined else tool) | tojson }}"
    "{{ '\\n' }}{% endfor %}"
    '{{ \'</tools>\\nCall a tool with <tool_call>\\n{"name": NAME, "arguments": ARGS}'
    "\\n</tool_call><|end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + (message['content'] or '') }}"
    "{% for call in message.tool_calls or [] %}"
    "{% set fn = call.function if call.function is defined else call %}"
    '{{ \'<tool_call>\\n{"name": "\' + fn.name + \'", "arguments": \' }}'
    "{{ (fn.arguments if fn.arguments is string else fn.arguments | tojson) + '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)
# Tokens that reasoning and tool-call parsers look for, as real checkpoints have them:
# single added tokens that are not special (they survive skip_special_tokens).
THINK_AND_TOOL_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")

_CORPUS = """\
The engine keeps a small pool of memory blocks and hands them out as requests grow.
Each block holds the keys and values of sixteen tokens, so a long prompt needs many blocks.
When the pool runs dry, the scheduler pauses the newest request and gives its blocks back.
A request that comes back later recomputes what it lost; nothing else has to change.
Prefix caching lets two prompts that start the same way share the blocks of that beginning.
The model reads the whole batch as one long sequence, and positions restart for every request.
Greedy decoding always picks the most likely next token; sampling draws from the distribution.
Temperature flattens or sharpens the distribution, and top-p keeps only the likeliest tokens.
She opened the window, looked at the river, and wrote three short letters before breakfast.
He said the train would leave at nine, but it was raining and the station was crowded.
Children played in the park while their parents talked about the weather and the harvest.
The library closes early on Sundays, so we went to the market and bought bread and apples.
In the morning the mountains were covered with snow, and the air smelled of pine and smoke.
A good question is often more useful than a quick answer, said the old teacher with a smile.
Numbers such as 1, 2, 3, 10, 42, 100 and 2024 appear in dates, prices and measurements.
What time is it? Where are you going? How many people came to the meeting yesterday?
Please write a short story about a robot who learns to paint the sea at sunset.
The capital of France is Paris, the capital of Japan is Tokyo, and Canada's is Ottawa.
Water boils at one hundred degrees, and ice melts when the temperature rises above zero.
def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5
{"name": "Alice", "age": 30, "city": "London", "tags": ["reader", "runner"]}
Thank you for your help. I will send the report tomorrow afternoon, after the review.
Once upon a time there was a small village by the sea where everyone knew each other.
The farmer counted his sheep every evening, and every evening one of them was missing.
Light travels faster than sound, which is why we see the lightning before the thunder.
Science asks how the world works; history asks how it came to be the way it is today.
"""


def _corpus_lines() -> list[str]:
    lines = [line for line in _CORPUS.splitlines() if line.strip()]
    # Lower-case and upper-case variants widen the merges without adding text to this file.
    return lines + [line.lower() for line in lines] + [line.upper() for line in lines[:8]]


@functools.lru_cache(maxsize=8)
def _tokenizer_json(vocab_size: int, added_tokens: tuple[str, ...] = ()) -> str:
    """Train the byte-level BPE tokenizer with exactly `vocab_size` tokens, the last ones
    `added_tokens` (single, non-special tokens); returns its JSON.

    Cached per process (tests build many models with the same vocabulary); the JSON string is
    immutable, so every caller gets an independent tokenizer object built from it.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    minimum = len(alphabet) + len(SPECIAL_TOKENS) + len(added_tokens)
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size={vocab_size} is too small; a byte-level BPE needs >= {minimum}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trained_size = vocab_size - len(added_tokens)
    trainer = BpeTrainer(
        vocab_size=trained_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer)
    missing = trained_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens(
            [AddedToken(f"<extra_{i}>", special=True, normalized=False) for i in range(missing)]
        )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return tok.to_str()


def build_tokenizer(
    vocab_size: int, model_max_length: int = 4096, added_tokens: tuple[str, ...] = ()
) -> Any:
    """A `PreTrainedTokenizerFast` with exactly `vocab_size` tokens and a chat template;
    `added_tokens` (e.g. THINK_AND_TOOL_TOKENS) are the last ids, one token each."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size, tuple(added_tokens))),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )


def build_hf_config(architecture: str, preset: str | None, dtype: str, **overrides: Any) -> Any:
    """The transformers config for `architecture` with the preset's sizes and `overrides`."""
    import transformers

    if architecture not in _ARCHITECTURES:
        raise ValueError(
            f"architecture={architecture!r} is not supported; choose one of "
            f"{sorted(_ARCHITECTURES)}"
        )
    preset = preset or "tiny"
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r} is not one of {sorted(PRESETS)}")
    cls_name, arch_defaults = _ARCHITECTURES[architecture]
    fields: dict[str, Any] = dict(
        hidden_act="silu",
        rms_norm_eps=1e-6,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        attention_dropout=0.0,
    )
    fields.update(arch_defaults)
    fields.update(PRESETS[preset])
    fields.update(overrides)
    config = getattr(transformers, cls_name)(**fields)
    config.architectures = [architecture]
    config.dtype = dtype
    return config


def _init_weights(model: Any, seed: int) -> None:
    """Seeded weights with useful scales: linear layers N(0, 1/fan_in) keep activations near
    unit size, norms near 1 and biases small but nonzero (so a skipped load shows up), and an
    LM head scaled for logits with a standard deviation of about 2.5."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    config = model.config
    hidden = config.hidden_size
    tied = bool(getattr(config, "tie_word_embeddings", False))
    head_std = 2.5 / math.sqrt(hidden)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied matrix is listed once
            if p.dim() == 1:
                scale, center = (0.1, 1.0) if "norm" in name else (0.05, 0.0)
            elif "embed_tokens" in name:
                scale, center = (head_std if tied else 1.0), 0.0
            elif name.startswith("lm_head"):
                scale, center = head_std, 0.0
            else:
                scale, center = 1.0 / math.sqrt(p.shape[1]), 0.0
            p.normal_(center, scale, generator=gen)


def _no_init_weights() -> contextlib.AbstractContextManager:
    """transformers' switch that skips its own (slow, here redundant) weight init."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers < 5
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


@contextlib.contextmanager
def _quiet_progress_bars():
    """Hide transformers' "Writing model shards" bar while saving; restore it afterwards."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    if enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def make_demo_model(
    path: str | os.PathLike,
    *,
    architecture: str = "LlamaForCausalLM",
    preset: str | None = None,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: int | str | None = None,
    added_tokens: tuple[str, ...] = (),
    **overrides: Any,
) -> str:
    """Write a complete random-weight checkpoint (weights, config, generation config and
    tokenizer) to `path` and return it as a string.

    `preset`: "tiny" (default), "demo", "llama-125m" or "llama-1b"; `**overrides` set any
    transformers config field (e.g. `rope_scaling`/`rope_parameters`, `head_dim`,
    `tie_word_embeddings`, `num_key_value_heads`, `vocab_size`). `max_shard_size` (e.g.
    "200KB") splits the weights into several safetensors files with an index.
    `added_tokens` end the tokenizer's vocabulary as single non-special tokens (e.g.
    THINK_AND_TOOL_TOKENS).
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={dtype!r} must be 'float32', 'bfloat16' or 'float16'")
    config = build_hf_config(architecture, preset, dtype, **overrides)
    # The tokenizer first: it validates vocab_size before anything is written.
    tokenizer = build_tokenizer(
        config.vocab_size, config.max_position_embeddings, tuple(added_tokens)
    )
    torch.manual_seed(seed)
    with _no_init_weights():  # every parameter is overwritten by _init_weights
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # skipped init also skips tying on some transformers versions
    _init_weights(model, seed)
    model = model.to(getattr(torch, dtype)).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=[EOS_ID, END_OF_TURN_ID], pad_token_id=PAD_ID
    )
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    with _quiet_progress_bars():
        model.save_pretrained(path, **save_kwargs)
    tokenizer.save_pretrained(path)
    return path


# ---------------------------------------------------------------- command line


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of `pagedllm make-demo-model DIR`."""
    parser.add_argument("path", metavar="DIR", help="directory to write the checkpoint to")
    parser.add_argument("--preset", default="demo", choices=sorted(PRESETS))
    parser.add_argument(
        "--architecture", default="LlamaForCausalLM", choices=sorted(_ARCHITECTURES)
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--max-shard-size", default=None, help="split the weights into shards, e.g. 100MB"
    )
    parser.add_argument(
        "--added-token",
        action="append",
        default=[],
        metavar="TOKEN",
        help="end the vocabulary with TOKEN as one non-special token, e.g. '<think>' (repeatable)",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a config field; VALUE is parsed as JSON when it can be (repeatable)",
    )
    return parser


def _parse_overrides(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--override {item!r} must look like KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def demo_model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`make_demo_model` keyword arguments from the options of `add_cli_args`."""
    return dict(
        architecture=args.architecture,
        preset=args.preset,
        seed=args.seed,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        added_tokens=tuple(args.added_token),
        **_parse_overrides(args.override),
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Run `pagedllm make-demo-model` with parsed arguments; prints the directory written."""
    path = make_demo_model(args.path, **demo_model_kwargs(args))
    print(f"wrote {args.architecture} ({args.preset}) checkpoint to {path}")
    return 0


def default_demo_model_dir() -> str:
    """The built-in demo model ("demo" preset), built on first use under
    `$XDG_CACHE_HOME/pagedllm/demo-model` (default `~/.cache/...`). It is written to a
    temporary sibling and renamed into place, so a concurrent or interrupted build never leaves
    a half-written model behind."""
    import shutil
    import tempfile

    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(cache, "pagedllm", "demo-model")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="demo-model-", dir=os.path.dirname(path))
    try:
        make_demo_model(tmp, preset="demo")
        try:
            os.rename(tmp, path)
        except OSError:  # another process finished first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
