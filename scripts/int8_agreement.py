"""Greedy agreement of `quantization="int8"` with the unquantized model on a real chat model,
three ways:
- free-running: the share of tokens before each request's first disagreement (after it the two
  continuations part, so every later token counts as disagreeing), and of positions equal;
- teacher-forced: each prompt followed by the unquantized model's own greedy continuation, run
  as a prompt through the int8 engine (`prompt_logprobs`): the share of those continuation
  tokens that are int8's top-1 too (no cascade: each position sees the same prefix). The
  unquantized engine run the same way gives the floor set by rounding alone (a prefill's
  products round differently from the decode steps that produced the continuation).

    python scripts/int8_agreement.py MODEL_DIR [--tokens 64] [--dtype bfloat16]

The prompts are the fixed instructions below, each through the model's chat template; the
engines run in this process one after the other (greedy, `ignore_eos`, so every request has
the same length). Issue 12 asks for 95% against bf16.
"""

from __future__ import annotations

import argparse
import os

PROMPTS = [
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    os.environ.setdefault("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
    from pagedllm import LLM, SamplingParams
    from pagedllm.transformers_utils.tokenizer import get_tokenizer

    tok = get_tokenizer(args.model)
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in PROMPTS
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    forced = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs, prompt_ids, top1 = {}, [], {}
    for q in (None, "int8"):
        llm = LLM(
            model=args.model,
            dtype=args.dtype,
            quantization=q,
            max_model_len=2048,
            kv_cache_memory=512 << 20,
        )
        got = llm.generate(prompts, params, use_tqdm=False)
        outs[q] = [list(o.outputs[0].token_ids) for o in got]
        if q is None:
            prompt_ids = [list(o.prompt_token_ids) for o in got]
        # The unquantized continuation as a prompt: is each of its tokens this engine's top-1?
        full = [{"prompt_token_ids": p + c} for p, c in zip(prompt_ids, outs[None])]
        hits = 0
        for o, p in zip(llm.generate(full, forced, use_tqdm=False), prompt_ids):
            for pos in range(len(p), len(o.prompt_token_ids)):
                entry = o.prompt_logprobs[pos][o.prompt_token_ids[pos]]
                hits += entry.rank == 1
        top1[q] = hits / sum(len(c) for c in outs[None])
        llm.shutdown()
    before_first = positions = total = identical = 0
    for a, b in zip(outs[None], outs["int8"]):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        before_first += first
        positions += sum(x == y for x, y in zip(a, b))
        total += len(a)
        identical += first == len(a)
    print(
        f"{len(prompts)} prompts x {args.tokens} greedy tokens, int8 against {args.dtype}: "
        f"free-running {before_first / total:.1%} of tokens before the first disagreement, "
        f"{positions / total:.1%} of positions equal, {identical}/{len(prompts)} requests "
        f"identical; teacher-forced top-1 {top1['int8']:.1%} (the {args.dtype} engine itself: "
        f"{top1[None]:.1%})"
    )


if __name__ == "__main__":
    main()
