"""Soak the OpenAI-compatible server: many concurrent streams for minutes, with random
disconnects, reused request ids and bad requests mixed in (not run in CI).

It starts `pagedllm serve` itself (so it knows both processes), runs the load in phases and,
after each phase, waits for the engine to be idle and records the engine's gauges and the RSS
of the API server and the engine process. It passes when no good request was lost (every one
answered 200 to the end: `[DONE]` and a finish reason per choice), every bad one got a 4xx in
OpenAI's shape, nothing answered 5xx, the gauges (running, waiting, KV-cache usage) are back to
zero after each phase and the server logged no internal error. Memory is reported per phase;
"flat" means the last phases end at about the same RSS.

    python scripts/soak_server.py --concurrency 1000 --duration 240 --phases 3
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pagedllm.benchmarks.server_process import stop_process, wait_healthy

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_ID = "soak-shared-id"  # reused by some good requests, concurrently
BODY_LIMIT = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> dict[str, float]:
    """Resident memory of `pid` in MiB: all of it, and its anonymous part (heap, tensors;
    file-backed pages such as shared libraries come and go with the page cache)."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                fields[key] = round(int(value.split()[0]) / 1024, 1)
    return {"rss": fields["VmRSS"], "anon": fields["RssAnon"]}


def engine_pid(server_pid: int) -> int:
    """The EngineCore child of the server (not multiprocessing's resource tracker)."""
    for child in Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split():
        if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
            return int(child)
    raise RuntimeError("no engine process found")


class Server:
    """`pagedllm serve` on a free port, stopped (SIGTERM) by `stop()`."""

    def __init__(self, model: str, extra: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="pagedllm-soak-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", model]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--disable-log-requests"]
        cmd += ["--max-request-body-bytes", str(BODY_LIMIT), *extra]
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.url, self.proc, 600)
        except (RuntimeError, TimeoutError) as e:
            log = self.log_path.read_text()[-3000:]
            raise RuntimeError(f"server did not start ({e}):\n{log}") from None
        self.engine_pid = engine_pid(self.proc.pid)

    def gauges(self) -> dict[str, float]:
        wanted = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        values = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            name = line.split("{")[0].split(" ")[0].split(":")[-1]
            if name in wanted and not line.startswith("#"):
                values[name] = float(line.rsplit(" ", 1)[1])
        return values

    def wait_idle(self, timeout: float = 300.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        gauges = self.gauges()
        while any(gauges.values()) and time.monotonic() < deadline:
            time.sleep(0.5)
            gauges = self.gauges()
        return gauges

    def memory(self) -> dict[str, float]:
        api, engine = rss_mib(self.proc.pid), rss_mib(self.engine_pid)
        return {
            f"{who}_{k}_mib": v
            for who, m in (("api", api), ("engine", engine))
            for k, v in m.items()
        }

    def stop(self) -> int:
        stop_process(self.proc)
        return self.proc.returncode


def _bad_requests() -> list[tuple[str, bytes]]:
    """(path, raw body) pairs the server must refuse with a 4xx."""
    deep = b'{"prompt": "x", "y": ' + b"[" * 200 + b"]" * 200 + b"}"
    return [
        ("/v1/completions", b'{"prompt": "\\ud800 lone surrogate"}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}'),
        ("/v1/completions", b'{"prompt": "hi", "n": 1000000}'),
        ("/v1/completions", b'{"prompt": "hi", "seed": 100000000000000000000000}'),
        ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"5": 1e9}}'),
        ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}'),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": -3}'),
        ("/v1/completions", b'{"prompt": "hi", "model": "nope"}'),
        ("/v1/completions", b'{"prompt": '),
        ("/v1/completions", b'{"prompt": "\xff\xfe"}'),
        ("/v1/completions", deep),
        ("/v1/completions", b'{"prompt": "' + b"a" * (BODY_LIMIT + 10) + b'"}'),
        ("/tokenize", b'{"prompt": "\\ud83d"}'),
        ("/v1/no-such-route", b"{}"),
    ]


class Soak:
    def __init__(self, server: Server, args: argparse.Namespace) -> None:
        self.server = server
        self.args = args
        self.counts: collections.Counter[str] = collections.Counter()
        self.failures: list[str] = []
        self.bad = _bad_requests()

    def fail(self, what: str) -> None:
        self.counts["failed"] += 1
        if len(self.failures) < 50:
            self.failures.append(what[:300])

    def _good_body(self, rng: random.Random, stream: bool) -> tuple[str, dict, dict]:
        n = 2 if rng.random() < 0.1 else 1
        common = {"max_tokens": rng.randint(4, self.args.max_tokens), "n": n}
        common.update(ignore_eos=True, stream=stream, temperature=rng.choice([0.0, 0.8]))
        headers = {"X-Request-Id": SHARED_ID} if rng.random() < 0.05 else {}
        if rng.random() < 0.5:
            words = " ".join(rng.choice(["soak", "test", "tokens", "server"]) for _ in range(20))
            return "/v1/completions", {"prompt": words, **common}, headers
        messages = [{"role": "user", "content": f"question {rng.randrange(10**6)}"}]
        return "/v1/chat/completions", {"messages": messages, **common}, headers

    async def good_stream(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        path, body, headers = self._good_body(rng, stream=True)
        finished: set[int] = set()
        last = ""
        async with http.stream("POST", path, json=body, headers=headers) as r:
            if r.status_code != 200:
                return self.fail(f"stream {r.status_code} {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line:
                    continue
                last = line
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        return self.fail(f"stream error event {line}")
                    for choice in event["choices"]:
                        if choice.get("finish_reason"):
                            finished.add(choice["index"])
        if last != "data: [DONE]" or finished != set(range(body["n"])):
            return self.fail(f"stream ended {last!r} with finished choices {sorted(finished)}")
        self.counts["good_stream"] += 1

    async def good_full(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        path, body, headers = self._good_body(rng, stream=False)
        r = await http.post(path, json=body, headers=headers)
        choices = r.json().get("choices", []) if r.status_code == 200 else []
        if len(choices) != body["n"] or not all(c["finish_reason"] for c in choices):
            return self.fail(f"full {r.status_code} {r.text[:200]}")
        self.counts["good_full"] += 1

    async def disconnect(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        path, body, headers = self._good_body(rng, stream=True)
        body["max_tokens"] = self.args.max_tokens * 4
        async with http.stream("POST", path, json=body, headers=headers) as r:
            events = 0
            async for line in r.aiter_lines():
                events += bool(line)
                if events >= rng.randint(1, 3):
                    break  # leaving the block closes the connection mid-stream
        self.counts["disconnect"] += 1

    async def bad_request(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        path, content = rng.choice(self.bad)
        r = await http.post(path, content=content, headers={"Content-Type": "application/json"})
        try:
            error = r.json()["error"]
            shaped = set(error) == {"message", "type", "param", "code"}
        except (ValueError, KeyError, TypeError):
            shaped = False
        if not 400 <= r.status_code < 500 or not shaped:
            return self.fail(f"bad request {path} {content[:60]!r}: {r.status_code} {r.text[:200]}")
        self.counts["bad_refused"] += 1

    async def worker(self, seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        a = self.args
        actions = [self.good_stream, self.good_full, self.disconnect, self.bad_request]
        weights = [1 - a.full_frac - a.disconnect_frac - a.bad_frac, a.full_frac]
        weights += [a.disconnect_frac, a.bad_frac]
        timeout = httpx.Timeout(a.request_timeout)
        async with httpx.AsyncClient(base_url=self.server.url, timeout=timeout) as http:
            while time.monotonic() < deadline:
                action = rng.choices(actions, weights)[0]
                try:
                    await action(http, rng)
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    if action is self.disconnect and isinstance(e, httpx.HTTPError):
                        continue
                    self.fail(f"{action.__name__}: {type(e).__name__}: {e}")

    async def phase(self, index: int, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        seeds = range(index * 100_000, index * 100_000 + self.args.concurrency)
        await asyncio.gather(*(self.worker(seed, deadline) for seed in seeds))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: a demo model)")
    parser.add_argument("--concurrency", type=int, default=1000)
    parser.add_argument("--duration", type=float, default=240.0, help="seconds, all phases")
    parser.add_argument("--phases", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--full-frac", type=float, default=0.15)
    parser.add_argument("--disconnect-frac", type=float, default=0.15)
    parser.add_argument("--bad-frac", type=float, default=0.10)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--server-arg", action="append", default=[], help="extra serve flag")
    args = parser.parse_args()

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the server inherits it
    model = args.model
    if model is None:
        from pagedllm.testing import make_demo_model

        model = make_demo_model(tempfile.mkdtemp(prefix="pagedllm-soak-model-"), seed=0)
    server = Server(model, ["--max-model-len", "512", *args.server_arg])
    report: dict = {"args": vars(args), "phases": []}
    try:
        report["start"] = {**server.memory(), **server.gauges()}
        soak = Soak(server, args)
        for i in range(args.phases):
            t0 = time.monotonic()
            asyncio.run(soak.phase(i, args.duration / args.phases))
            load_s = time.monotonic() - t0
            gauges = server.wait_idle()
            # Counts are cumulative over the phases.
            row = {"phase": i, "load_s": round(load_s, 1), **dict(soak.counts)}
            row.update(gauges, **server.memory())
            report["phases"].append(row)
            print(json.dumps(row), flush=True)
        log = server.log_path.read_text(errors="replace")
        report["internal_errors_logged"] = log.count("Internal error")
        report["failures"] = soak.failures
    finally:
        report["exit_code"] = server.stop()
    print(json.dumps(report, indent=1))
    gauge_names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    idle = all(not any(p[g] for g in gauge_names) for p in report["phases"])
    ok = not report["failures"] and idle and report["internal_errors_logged"] == 0
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
