"""Greedy agreement between two engines on a real chat model (issue 12's int8 target, measured
by scripts/int8_agreement.py and tests/real_model/test_int8_agreement.py):
- free-running: each engine's own greedy continuation; the share of tokens before each
  request's first disagreement (after it the continuations part, so every later token
  disagrees) and of positions equal;
- teacher-forced: the reference engine's continuation run as a prompt through the other
  engine (`prompt_logprobs`): the share of its tokens that engine ranks first too. Each
  position sees the same prefix, so one flip counts once."""

from __future__ import annotations

from typing import Any

from pagedllm.sampling_params import SamplingParams

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers greater than 50.",
    "How do I reverse a list in Python?",
    "Give me a synonym for 'happy'.",
    "What causes the seasons on Earth?",
    "Translate 'good morning' into Spanish.",
    "Summarize the plot of Romeo and Juliet.",
    "What is 17 times 23?",
    "Name a famous painting by Vincent van Gogh.",
    "Why is the sky blue?",
    "Write a short thank-you note to a teacher.",
    "What are the three states of matter?",
    "Describe a cat to someone who has never seen one.",
    "How many days are there in a leap year?",
    "Suggest a name for a coffee shop.",
    "What does a CPU do in a computer?",
    "Give two tips for sleeping better.",
    "Who wrote 'Pride and Prejudice'?",
    "Explain what a black hole is to a child.",
    "What is the boiling point of water in Fahrenheit?",
    "Write one sentence that uses the word 'serendipity'.",
    "What is the difference between weather and climate?",
    "Recommend a healthy breakfast.",
    "How does a rainbow form?",
    "What is the largest planet in the solar system?",
    "Write a limerick about a dog.",
    "What is machine learning?",
    "Name three countries in South America.",
    "How do bees make honey?",
    "What should I pack for a weekend hiking trip?",
]


def chat_prompts(tokenizer: Any, count: int | None = None) -> list[str]:
    """The first `count` of CHAT_PROMPTS (all by default) through the model's chat template."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in CHAT_PROMPTS[:count]
    ]


def greedy_continuations(llm: Any, prompts: list[str], tokens: int):
    """(prompt token ids, greedy continuations of exactly `tokens` tokens) per prompt."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.prompt_token_ids) for o in outs], [list(o.outputs[0].token_ids) for o in outs]


def teacher_forced_top1(llm: Any, prompt_ids: list[list[int]], continuations: list[list[int]]):
    """The share of the continuations' tokens that `llm` ranks first after their prefixes."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    full = [{"prompt_token_ids": p + c} for p, c in zip(prompt_ids, continuations)]
    hits = 0
    for out, p in zip(llm.generate(full, params, use_tqdm=False), prompt_ids):
        for pos in range(len(p), len(out.prompt_token_ids)):
            hits += out.prompt_logprobs[pos][out.prompt_token_ids[pos]].rank == 1
    return hits / sum(len(c) for c in continuations)


def free_running(a: list[list[int]], b: list[list[int]]) -> tuple[float, float, int]:
    """(share of tokens before each request's first disagreement, share of positions equal,
    requests identical) of two engines' continuations of the same prompts."""
    before_first = positions = total = identical = 0
    for x, y in zip(a, b):
        first = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x))
        before_first += first
        positions += sum(u == v for u, v in zip(x, y))
        total += len(x)
        identical += first == len(x)
    return before_first / total, positions / total, identical


def compare_engines(
    model: str, dtype: str, tokens: int, variants: dict[str, dict[str, Any]]
) -> tuple[int, dict[str, list[list[int]]], dict[str, float]]:
    """Each variant's engine (`LLM` keyword arguments over `model` in `dtype`; the first is
    the reference) run in turn over the chat prompts: (prompt count, greedy continuations by
    variant, teacher-forced top-1 agreement with the reference's continuations by variant)."""
    from pagedllm import LLM
    from pagedllm.transformers_utils.tokenizer import get_tokenizer

    prompts = chat_prompts(get_tokenizer(model))
    reference = next(iter(variants))
    outs: dict[str, list[list[int]]] = {}
    top1: dict[str, float] = {}
    prompt_ids: list[list[int]] = []
    for name, kwargs in variants.items():
        llm = LLM(model=model, dtype=dtype, max_model_len=2048, kv_cache_memory=512 << 20, **kwargs)
        ids, outs[name] = greedy_continuations(llm, prompts, tokens)
        prompt_ids = prompt_ids or ids
        top1[name] = teacher_forced_top1(llm, prompt_ids, outs[reference])
        llm.shutdown()
    return len(prompts), outs, top1
