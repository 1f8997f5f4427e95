"""StructuredOutputManager inside the Scheduler, without a model: a fake runner samples a random
token the step's bitmask allows. Covers WAITING_FOR_FSM, the compile cache, bitmask rows (none
for a partial prefill chunk), the grammar's end finishing a request, preemption, aborts, a
grammar that fails to compile in the core, and speculative decoding: drafts cut to what the
grammar accepts, one bitmask row per verified position, the matcher rolled back."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched.output import CachedRequestData, SchedulerOutput
from pagedllm.core.sched.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.bitmask import unpack_bitmask
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.testing.demo_model import END_OF_TURN_ID, EOS_ID
from tests.core.utils import make_runner_output
from tests.structured_output.schemas import CHOICES, PERSON_SCHEMA, check_json

VOCAB = 512
CHOICE = StructuredOutputsParams(choice=CHOICES)
PERSON = StructuredOutputsParams(json=PERSON_SCHEMA, disable_any_whitespace=True)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from pagedllm.transformers_utils.tokenizer import get_tokenizer

    return get_tokenizer(tiny_llama_dir)


@pytest.fixture
def make_scheduler(tiny_llama_dir, make_engine_config):
    def make(max_num_batched_tokens: int = 512, num_blocks: int = 256, speculative=False):
        config = make_engine_config(tiny_llama_dir)
        if speculative:  # ngram: the scheduler reserves draft slots; no proposer runs here
            config.extra["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3}
        config.scheduler_config.max_num_batched_tokens = max_num_batched_tokens
        config.cache_config.num_blocks = num_blocks
        manager = StructuredOutputManager(config)
        return Scheduler(config, manager), manager

    return make


def _request(req_id: str, spec=None, prompt_len: int = 8, **kwargs) -> Request:
    params = SamplingParams(structured_outputs=spec, **{"max_tokens": 300, **kwargs})
    params.update_from_generation_config({}, [EOS_ID, END_OF_TURN_ID])
    prompt = [10 + (i * 7 + len(req_id)) % 400 for i in range(prompt_len)]
    return Request(req_id, prompt, params, eos_token_id=EOS_ID)


def _allowed(so, req_id: str) -> list[int]:
    row = so.structured_output_request_ids[req_id]
    packed = torch.from_numpy(so.grammar_bitmask[row : row + 1])
    return torch.nonzero(unpack_bitmask(packed, VOCAB)[0]).flatten().tolist()


def _step(scheduler: Scheduler, rng: random.Random, forced: dict[str, int] | None = None):
    """schedule -> fake runner (a random allowed token, 100 for unconstrained requests) ->
    update. Returns (scheduler output, engine outputs)."""
    so = scheduler.schedule()
    tokens = {}
    for req_id in so.num_scheduled_tokens:
        if forced and req_id in forced:
            tokens[req_id] = [forced[req_id]]
        elif req_id in so.structured_output_request_ids:
            tokens[req_id] = [rng.choice(_allowed(so, req_id))]
        else:
            tokens[req_id] = [100]
    outputs = scheduler.update_from_output(so, make_runner_output(scheduler, so, tokens))
    scheduler.check_integrity()
    return so, outputs


def _run(scheduler: Scheduler, seed: int = 0, max_steps: int = 2000) -> dict[str, list]:
    rng = random.Random(seed)
    results: dict[str, list] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return results
        so, outputs = _step(scheduler, rng)
        if so.is_empty:
            time.sleep(0.005)  # only grammars compiling: let the compiler thread run
        for out in outputs.outputs:
            entry = results.setdefault(out.request_id, [[], None])
            entry[0].extend(out.new_token_ids)
            entry[1] = out.finish_reason
    raise AssertionError("requests did not finish")


def _text(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def test_waits_for_fsm_without_blocking_others(make_scheduler):
    scheduler, manager = make_scheduler()
    gate = threading.Event()
    compile_ = manager.backend.compile
    manager.backend.compile = lambda spec: (gate.wait(10), compile_(spec))[1]
    structured, plain = _request("s", CHOICE), _request("p")
    scheduler.add_request(structured)
    scheduler.add_request(plain)
    assert structured.status == RequestStatus.WAITING_FOR_FSM
    so, _ = _step(scheduler, random.Random(0))
    assert list(so.num_scheduled_tokens) == ["p"] and so.grammar_bitmask is None
    gate.set()
    manager._requests["s"].future.result(timeout=10)
    so, _ = _step(scheduler, random.Random(0))
    assert "s" in so.num_scheduled_tokens and so.structured_output_request_ids == {"s": 0}
    assert so.grammar_bitmask.shape == (1, VOCAB // 32) and so.grammar_bitmask.dtype.name == "int32"
    # The compiled grammar is cached: a request with the same spec is ready at once.
    again = _request("s2", StructuredOutputsParams(choice=list(CHOICES)))
    scheduler.add_request(again)
    assert again.status == RequestStatus.WAITING


def test_runs_to_the_end_of_the_grammar(make_scheduler, tokenizer):
    scheduler, manager = make_scheduler()
    for i in range(6):
        scheduler.add_request(_request(f"c{i}", CHOICE, ignore_eos=True))
        scheduler.add_request(_request(f"j{i}", PERSON))
    scheduler.add_request(_request("plain", max_tokens=5))
    results = _run(scheduler)
    for req_id, (tokens, reason) in results.items():
        if req_id == "plain":
            assert tokens == [100] * 5 and str(reason) == "length"
            continue
        assert str(reason) == "stop"
        assert tokens[-1] in (EOS_ID, END_OF_TURN_ID)  # ended by a stop token the grammar chose
        text = _text(tokenizer, tokens)
        if req_id.startswith("c"):
            assert text in CHOICES  # ignore_eos: the grammar's end finished it
        else:
            check_json(text, PERSON_SCHEMA)
    assert manager.num_requests == 0


def test_no_bitmask_row_for_a_partial_prefill_chunk(make_scheduler):
    scheduler, _ = make_scheduler(max_num_batched_tokens=16)
    scheduler.add_request(_request("s", CHOICE, prompt_len=40))
    scheduler.structured_output_manager._requests["s"].future.result(timeout=10)
    rows = [_step(scheduler, random.Random(0))[0].structured_output_request_ids for _ in range(4)]
    assert rows == [{}, {}, {"s": 0}, {"s": 0}]  # chunks of 16, 16, 8 tokens; then a decode


def test_preemption_keeps_the_matcher(make_scheduler, tokenizer):
    """Two long requests in a cache that holds one: they preempt each other, recompute their
    generated tokens, and their matchers (not re-fed) still produce whole JSON documents."""
    scheduler, manager = make_scheduler(num_blocks=32)  # 512 tokens, the tiny max_model_len
    for i in range(3):
        scheduler.add_request(_request(f"r{i}", PERSON, prompt_len=200))
    results = _run(scheduler, seed=1)
    assert scheduler.num_preemptions_total > 0
    for tokens, reason in results.values():
        assert str(reason) == "stop"
        check_json(_text(tokenizer, tokens), PERSON_SCHEMA)


def test_a_rejected_token_stops_the_request(make_scheduler, tokenizer):
    scheduler, manager = make_scheduler()
    scheduler.add_request(_request("s", CHOICE))
    manager._requests["s"].future.result(timeout=10)
    z = tokenizer.convert_tokens_to_ids("z")  # no choice starts with "z"
    so, outputs = _step(scheduler, random.Random(0), forced={"s": z})
    assert z not in _allowed(so, "s")
    (out,) = outputs.outputs
    assert out.new_token_ids == [z] and str(out.finish_reason) == "stop"
    assert manager.num_requests == 0


def test_abort_while_compiling_frees_the_state(make_scheduler):
    scheduler, manager = make_scheduler()
    gate = threading.Event()
    compile_ = manager.backend.compile
    manager.backend.compile = lambda spec: (gate.wait(10), compile_(spec))[1]
    scheduler.add_request(_request("s", CHOICE))
    scheduler.finish_requests("s", RequestStatus.FINISHED_ABORTED)
    gate.set()
    assert manager.num_requests == 0 and not scheduler.has_unfinished_requests()


def test_a_grammar_failing_in_the_core_can_only_stop(make_scheduler):
    """The front end rejects bad specs; should one reach the core anyway, its request is
    logged and ends at once with a stop token instead of running unconstrained."""
    scheduler, manager = make_scheduler()
    bad = StructuredOutputsParams(regex="[a-")  # no front-end validation on this path
    scheduler.add_request(_request("bad", bad))
    manager._requests["bad"].future.exception(timeout=10)
    so, outputs = _step(scheduler, random.Random(0))
    assert set(_allowed(so, "bad")) == {EOS_ID, END_OF_TURN_ID}
    (out,) = outputs.outputs
    assert str(out.finish_reason) == "stop" and out.new_token_ids[0] in (EOS_ID, END_OF_TURN_ID)


# ---- speculative decoding: drafts validated, one bitmask row per verified position ----------


def _ready(manager: StructuredOutputManager, request: Request) -> None:
    manager._requests[request.request_id].future.result(timeout=10)
    assert manager.is_ready(request)


def _reference_masks(manager, spec, tokens: list[int], num_rows: int) -> torch.Tensor:
    """The mask of a fresh matcher after each of tokens[:n], n = len - num_rows + 1 .. len."""
    grammar = manager.backend.new_grammar(manager.backend.compile(spec))
    masks = torch.zeros(num_rows, VOCAB // 32, dtype=torch.int32)
    start = len(tokens) - num_rows + 1
    for t in tokens[:start]:
        assert grammar.accept_token(t)
    for j in range(num_rows):
        grammar.fill_bitmask(masks, j)
        if j < num_rows - 1:
            assert grammar.accept_token(tokens[start + j])
    return masks


def _verifying(request: Request, drafts: list[int]) -> SchedulerOutput:
    """A step that verifies `drafts` after the request's last token."""
    request.num_computed_tokens = request.num_tokens - 1
    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={request.request_id: 1 + len(drafts)},
        total_num_scheduled_tokens=1 + len(drafts),
        scheduled_spec_decode_tokens={request.request_id: drafts} if drafts else {},
    )


def test_fill_bitmask_with_drafts_walks_them_and_rolls_back(make_scheduler, tokenizer):
    _, manager = make_scheduler()
    spec = StructuredOutputsParams(json=PERSON_SCHEMA, disable_any_whitespace=True)
    ids = tokenizer.encode('{"name": "Al", "age": 3', add_special_tokens=False)
    request = _request("s", spec)
    manager.add_request(request)
    _ready(manager, request)
    for t in ids[:4]:  # generated so far
        request.append_output_token_ids(t)
        assert not manager.accept_token(request, t)
    drafts = ids[4:7]
    plain, other = _request("p", max_tokens=5), _request("t", CHOICE)
    manager.add_request(other)
    _ready(manager, other)
    so = _verifying(request, drafts)
    for r, num in ((plain, 3), (other, 1)):  # a plain request with drafts, a structured one
        r.num_computed_tokens = r.num_tokens - 1
        so.num_scheduled_tokens[r.request_id] = num
    so.scheduled_spec_decode_tokens["p"] = [5, 6]

    manager.fill_bitmask(so, {"s": request, "p": plain, "t": other})
    assert so.structured_output_request_ids == {"s": 0, "t": 4}
    assert so.grammar_bitmask.shape == (5, VOCAB // 32)
    expected = _reference_masks(manager, spec, ids[:7], num_rows=4)
    assert torch.equal(torch.from_numpy(so.grammar_bitmask[:4]), expected)
    # The matcher is where it was: same mask, and it takes the drafts again.
    again = torch.zeros(1, VOCAB // 32, dtype=torch.int32)
    manager._requests["s"].grammar.fill_bitmask(again, 0)
    assert torch.equal(again[0], expected[0])
    assert manager.validate_tokens("s", drafts) == drafts


def test_rows_after_a_refused_or_stop_draft_allow_everything(make_scheduler, tokenizer):
    _, manager = make_scheduler()
    request = _request("s", CHOICE)
    manager.add_request(request)
    _ready(manager, request)
    it, d = tokenizer.encode("it d", add_special_tokens=False)
    z = tokenizer.convert_tokens_to_ids("z")
    # Unvalidated drafts: "it", then "z" (refused): rows 2 and 3 follow no matcher state.
    so = _verifying(request, [it, z, d])
    manager.fill_bitmask(so, {"s": request})
    rows = so.grammar_bitmask
    assert (rows[2:] == -1).all() and not (rows[:2] == -1).all(axis=1).any()
    # A stop token ends the walk: the row after it allows everything.
    yes = tokenizer.encode("yes", add_special_tokens=False)
    so = _verifying(request, [*yes, EOS_ID])
    manager.fill_bitmask(so, {"s": request})
    rows = so.grammar_bitmask
    assert (rows[-1] == -1).all() and not (rows[:-1] == -1).all(axis=1).any()
    before_stop = unpack_bitmask(torch.from_numpy(rows[-2:-1]), VOCAB)[0]
    assert torch.nonzero(before_stop).flatten().tolist() == [EOS_ID, END_OF_TURN_ID]
    assert manager.validate_tokens("s", [it, z, d]) == [it]
    assert manager.validate_tokens("s", [*yes, EOS_ID, it]) == [*yes, EOS_ID]


def test_drafts_are_cut_to_what_the_grammar_accepts(make_scheduler, tokenizer):
    """The scheduler stores a structured request's drafts cut at the first one its grammar
    refuses, then schedules them with one bitmask row per verified position; a plain request
    keeps all of its drafts, and a request whose grammar failed gets none."""
    scheduler, manager = make_scheduler(speculative=True)
    requests = {"s": _request("s", CHOICE), "p": _request("p")}
    bad = _request("bad", StructuredOutputsParams(regex="[a-"))
    for r in (*requests.values(), bad):
        scheduler.add_request(r)
    _ready(manager, requests["s"])
    manager._requests["bad"].future.exception(timeout=10)
    assert manager.validate_tokens("bad", [1, 2]) == []
    it, d, ep = tokenizer.encode("it dep", add_special_tokens=False)
    z = tokenizer.convert_tokens_to_ids("z")
    so = scheduler.schedule()
    mro = make_runner_output(scheduler, so, {"s": [it], "p": [100], "bad": [EOS_ID]})
    mro.spec_token_ids = [[d, z, ep] for _ in mro.req_ids]
    scheduler.update_from_output(so, mro)
    assert requests["s"].spec_token_ids == [d]
    assert requests["p"].spec_token_ids == [d, z, ep]
    so = scheduler.schedule()
    assert so.scheduled_spec_decode_tokens == {"s": [d], "p": [d, z, ep]}
    assert so.structured_output_request_ids == {"s": 0} and so.grammar_bitmask.shape[0] == 2
    assert d in _allowed(so, "s")


# ---- reasoning models: the grammar starts after the reasoning ends --------------------------


@pytest.fixture(scope="module")
def think_model_dir(tmp_path_factory):
    from pagedllm.testing import make_demo_model
    from pagedllm.testing.demo_model import THINK_AND_TOOL_TOKENS

    path = tmp_path_factory.mktemp("tiny-think")
    return make_demo_model(path, preset="tiny", added_tokens=THINK_AND_TOOL_TOKENS)


def test_grammar_waits_for_the_end_of_reasoning(think_model_dir, make_engine_config):
    from pagedllm.transformers_utils.tokenizer import get_tokenizer

    config = make_engine_config(think_model_dir)
    config.structured_outputs_config.reasoning_parser = "deepseek_r1"
    config.cache_config.num_blocks = 256
    manager = StructuredOutputManager(config)
    scheduler = Scheduler(config, manager)
    tok = get_tokenizer(think_model_dir)
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])

    def request(req_id: str, prompt_end: list[int]) -> Request:
        params = SamplingParams(structured_outputs=PERSON, max_tokens=300)
        params.update_from_generation_config({}, [EOS_ID, END_OF_TURN_ID])
        return Request(req_id, [20, 30, 40, *prompt_end], params, eos_token_id=EOS_ID)

    thinking = request("think", [start])  # the template opened the think block
    closed = request("closed", [start, end])  # ... or closed it (enable_thinking=False)
    for r in (thinking, closed):
        scheduler.add_request(r)
    while manager._requests["think"].future.running():
        time.sleep(0.01)
    rng = random.Random(0)
    # While reasoning: no bitmask row, free tokens (here 100, then the end token), and
    # drafts stop before the end token.
    for token in (100, 101, end):
        so, _ = _step(scheduler, rng, forced={"think": token})
        assert "think" not in (so.structured_output_request_ids or {})
        assert "closed" in so.structured_output_request_ids
    assert manager._requests["think"].reasoning_ended
    assert manager.validate_tokens("think", [5, end, 6]) != [5, end, 6]  # constrained now
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        _step(scheduler, rng)
    assert not scheduler.has_unfinished_requests()
    output = thinking.output_token_ids
    assert output[:3] == [100, 101, end]
    check_json(tok.decode(output[3:], skip_special_tokens=True), PERSON_SCHEMA)
    check_json(tok.decode(closed.output_token_ids, skip_special_tokens=True), PERSON_SCHEMA)


def test_drafts_stop_before_the_end_of_reasoning(think_model_dir, make_engine_config):
    config = make_engine_config(think_model_dir)
    config.structured_outputs_config.reasoning_parser = "qwen3"
    manager = StructuredOutputManager(config)
    request = _request("r", CHOICE)
    manager.add_request(request)
    manager._requests["r"].future.result()
    manager.is_ready(request)
    end = manager.reasoner.end_token_id
    assert manager.validate_tokens("r", [7, 8, end, 9]) == [7, 8]
    assert manager.validate_tokens("r", [7, 8]) == [7, 8]
    assert not manager.accept_token(request, 7)
    assert not manager.accept_token(request, end)
    assert manager._requests["r"].reasoning_ended


def test_enable_in_reasoning_constrains_the_reasoning_too(think_model_dir, make_engine_config):
    """structured_outputs_config.enable_in_reasoning: the grammar applies from the first
    token, even to a request whose prompt opened a think block."""
    from pagedllm.transformers_utils.tokenizer import get_tokenizer

    config = make_engine_config(think_model_dir)
    config.structured_outputs_config.reasoning_parser = "deepseek_r1"
    config.structured_outputs_config.enable_in_reasoning = True
    config.cache_config.num_blocks = 256
    manager = StructuredOutputManager(config)
    scheduler = Scheduler(config, manager)
    start = get_tokenizer(think_model_dir).convert_tokens_to_ids("<think>")
    params = SamplingParams(structured_outputs=PERSON, max_tokens=300)
    params.update_from_generation_config({}, [EOS_ID, END_OF_TURN_ID])
    scheduler.add_request(Request("think", [20, 30, 40, start], params, eos_token_id=EOS_ID))
    while manager._requests["think"].future.running():
        time.sleep(0.01)
    assert manager._requests["think"].reasoning_ended
    so, _ = _step(scheduler, random.Random(0))
    assert "think" in so.structured_output_request_ids  # a bitmask row from the first step
