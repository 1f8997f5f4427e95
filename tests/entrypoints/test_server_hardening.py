"""The server under abuse, over HTTP against one live `pagedllm serve` (tiny Llama, small
limits): a reused request id touches no other request, bad input of every kind is a 400 in
OpenAI's shape that names the field or the limit, the event loop keeps answering while a huge
prompt is tokenized, and a bounded schemathesis fuzz of the OpenAPI schema finds no 5xx and no
error body of another shape (`make fuzz` runs a longer one)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import httpx
import pytest

from tests.entrypoints.conftest import RemoteServer

MAX_BODY = 4 << 20
MAX_PROMPT_CHARS = 2_000_000
MAX_N = 4
SERVER_ARGS = [
    "--dtype", "float32",
    "--max-model-len", "256",
    "--kv-cache-memory", str(4 << 20),
    "--max-request-body-bytes", str(MAX_BODY),
    "--max-prompt-chars", str(MAX_PROMPT_CHARS),
    "--max-n-sequences", str(MAX_N),
]  # fmt: skip
# Examples per operation and generation mode (positive, negative) of the fuzz.
FUZZ_EXAMPLES_ENV = "PAGEDLLM_FUZZ_EXAMPLES"


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with RemoteServer(tiny_llama_dir, SERVER_ARGS) as srv:
        yield srv


def assert_openai_error(response: httpx.Response, status: int, needle: str = "") -> dict:
    """The response is `status` with exactly OpenAI's error body; returns its `error`."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == status and isinstance(error["type"], str) and error["type"]
    assert needle in error["message"], error
    return error


def engine_gauges(server) -> dict[str, float]:
    """running / waiting requests and KV-cache usage, whatever the metric prefix."""
    wanted = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    values = {}
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        name = line.split("{")[0].split(" ")[0].split(":")[-1]
        if name in wanted and not line.startswith("#"):
            values[name] = float(line.rsplit(" ", 1)[1])
    assert set(values) == set(wanted), values
    return values


def wait_engine_idle(server, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while any(engine_gauges(server).values()):
        assert time.monotonic() < deadline, f"engine still busy: {engine_gauges(server)}"
        time.sleep(0.2)


def test_reused_request_id_touches_no_other_request(server):
    """Clients reusing one id (header and body, n = 2, streaming and not, one of them bad)
    each get their own definite answer; the first stream ends with [DONE]; the engine ends
    idle."""
    body = {"prompt": "same id", "max_tokens": 24, "n": 2, "ignore_eos": True}
    body["request_id"] = "dup"
    headers = {"X-Request-Id": "dup"}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            async with http.stream(
                "POST", "/v1/completions", json={**body, "stream": True}, headers=headers
            ) as first:
                assert first.status_code == 200
                lines = first.aiter_lines()
                events = [await anext(lines)]  # the first is running in the engine now
                bad = http.post(
                    "/v1/completions", json={**body, "temperature": -1}, headers=headers
                )
                full = http.post("/v1/completions", json=body, headers=headers)
                stream = http.post(
                    "/v1/chat/completions",
                    json={
                        "messages": [{"role": "user", "content": "hi"}],
                        **{k: body[k] for k in ("max_tokens", "n", "ignore_eos", "request_id")},
                        "stream": True,
                    },
                    headers=headers,
                )
                others = await asyncio.gather(bad, full, stream)
                events += [line async for line in lines if line]
        return events, others

    events, (bad, full, chat_stream) = asyncio.run(run())
    assert_openai_error(bad, 400, "temperature")
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all(c["id"] == "cmpl-dup" for c in chunks)
    finished = {c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]}
    assert finished == {0, 1}
    assert full.status_code == 200 and full.json()["id"] == "cmpl-dup"
    assert [c["finish_reason"] for c in full.json()["choices"]] == ["length", "length"]
    assert chat_stream.status_code == 200
    assert chat_stream.text.rstrip().endswith("data: [DONE]")
    assert chat_stream.text.count('"finish_reason":"length"') == 2
    wait_engine_idle(server)


def _deep(levels: int) -> str:
    return '{"prompt": "hi", "x": ' + "[" * levels + "]" * levels + "}"


@pytest.mark.parametrize(
    "path, content, status, needle",
    [
        ("/v1/completions", '{"prompt": "\\ud800 hi"}', 400, "prompt contains a lone UTF-16"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "ok \\udfff"}]}',
            400,
            "messages[0].content contains a lone UTF-16",
        ),
        ("/tokenize", '{"prompt": "\\ud800"}', 400, "prompt contains a lone UTF-16"),
        ("/detokenize", '{"tokens": [5], "model": "\\udbff"}', 400, "model contains a lone"),
        ("/v1/completions", '{"prompt": "hi", "seed": 1e30}', 400, "seed"),
        ("/v1/completions", '{"prompt": "hi", "seed": 10000000000000000000000}', 400, "64 bits"),
        ("/v1/completions", '{"prompt": "hi", "seed": 9223372036854775808}', 400, "seed must"),
        ("/v1/completions", '{"prompt": "hi", "n": 5}', 400, "--max-n-sequences"),
        ("/v1/completions", '{"prompt": "hi", "logit_bias": {"5": 101}}', 400, "[-100, 100]"),
        ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', 400, "temperature=nan"),
        ("/v1/completions", '{"prompt": "hi", "top_p": 1e400}', 400, "top_p=inf"),
        ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "not valid UTF-8"),
        ("/v1/completions", _deep(65), 400, "deeper than 64 levels"),
        ("/v1/completions", _deep(100_000), 400, "deeper than 64 levels"),
        ("/v1/completions", '{"prompt": ', 400, "not valid JSON"),
        ("/v1/completions", "", 400, "JSON object body"),
        ("/v1/completions", '{"prompt": "hi", "max_tokens": "many"}', 400, "max_tokens"),
        ("/v1/nothing-here", "{}", 404, "Not found: POST /v1/nothing-here"),
        ("/v1/completions", '{"prompt": "hi", "model": "gpt-17"}', 404, "gpt-17"),
    ],
)
def test_bad_input_is_an_openai_error(server, path, content, status, needle):
    r = httpx.post(
        f"{server.url}{path}", content=content, headers={"Content-Type": "application/json"}
    )
    assert_openai_error(r, status, needle)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 10_000}, "logprobs"),
        (  # chat's field is top_logprobs (SamplingParams.logprobs inside)
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "logprobs": True,
                "top_logprobs": 10_000,
            },
            "top_logprobs",
        ),
    ],
)
def test_sampling_errors_name_their_field(server, path, body, param):
    """A value SamplingParams or the engine refuses: the 400's `param` is the request's field."""
    error = assert_openai_error(httpx.post(f"{server.url}{path}", json=body), 400)
    assert error["param"] == param, error


def test_limits_and_methods(server):
    url = server.url
    assert_openai_error(httpx.get(f"{url}/v1/completions"), 405, "not allowed")
    for body in (b"x" * (MAX_BODY + 1), iter([b"x" * (1 << 20)] * 5)):  # sized, then chunked
        r = httpx.post(f"{url}/v1/completions", content=body)
        assert_openai_error(r, 400, "--max-request-body-bytes")
    long_prompt = {"prompt": "a" * (MAX_PROMPT_CHARS + 1)}
    for path in ("/v1/completions", "/tokenize"):
        error = assert_openai_error(httpx.post(f"{url}{path}", json=long_prompt), 400)
        assert "--max-prompt-chars" in error["message"] and error["param"] == "prompt"
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "fine", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_event_loop_answers_while_a_huge_prompt_is_tokenized(server):
    """/health keeps answering during the big request's life (ordering, not timing): some
    answer arrives in its second half, which tokenizing (off the loop) fills."""
    prompt = "lorem ipsum dolor sit amet " * ((MAX_PROMPT_CHARS - 100) // 27)
    done: dict[str, float] = {}

    def big_request():
        t0 = time.monotonic()
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt}, timeout=300)
        done.update(start=t0, end=time.monotonic(), status=r.status_code)
        done["message"] = r.json()["error"]["message"]

    thread = threading.Thread(target=big_request)
    thread.start()
    answers = []
    with httpx.Client(base_url=server.url, timeout=300) as http:
        while thread.is_alive():
            assert http.get("/health").status_code == 200
            answers.append(time.monotonic())
    thread.join()
    assert done["status"] == 400 and "maximum context length" in done["message"]
    midpoint = (done["start"] + done["end"]) / 2
    assert any(midpoint < t < done["end"] for t in answers), (done, answers[-5:])


def _is_openai_error(r) -> bool:
    try:
        error = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return set(error) == {"message", "type", "param", "code"} and error["code"] == r.status_code


def _fuzz(operation, mode, url: str, examples: int, failures: list[str]) -> None:
    """`examples` requests for `operation` in generation `mode`; bad answers to `failures`."""
    import hypothesis
    from hypothesis import HealthCheck, Phase, given, settings

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,  # the same examples every run: a failure reproduces
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case):
        r = case.call(base_url=url, timeout=120)
        if r.status_code >= 500 or (r.status_code >= 400 and not _is_openai_error(r)):
            failures.append(f"{operation.label} {r.status_code} {r.text[:200]!r}")

    try:
        check()
    except hypothesis.errors.Unsatisfiable:
        pass  # no schema-violating request exists (an operation without input)


def test_schema_fuzz_finds_no_5xx_and_only_openai_errors(server):
    """schemathesis: schema-valid and schema-violating requests for every operation."""
    import schemathesis
    from schemathesis.generation import GenerationMode

    examples = int(os.environ.get(FUZZ_EXAMPLES_ENV, "25"))
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    failures: list[str] = []
    for result in schema.get_all_operations():
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz(result.ok(), mode, server.url, examples, failures)
    assert not failures, "\n".join(failures[:20])
    wait_engine_idle(server)
