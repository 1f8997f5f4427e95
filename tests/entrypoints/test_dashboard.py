"""The dashboard (`/dashboard`): its routes and API-key scheme on an app without an engine,
its SSE stream on a live server under load, and the page itself in a real headless browser
(Playwright driving Debian's chromium; skipped, saying why, where there is none)."""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from pagedllm.engine import EngineSnapshot, SchedulerStats
from pagedllm.entrypoints.dashboard.routes import COOKIE_NAME, dashboard_token
from pagedllm.entrypoints.dashboard.state import (
    POINT_FIELDS,
    DashboardStatLogger,
    percentile,
)
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.cli_args import make_arg_parser
from pagedllm.metrics.stats import IterationStats
from tests.entrypoints.conftest import API_KEY, RemoteServer

ARGS = [
    "--dtype", "float32",
    "--max-model-len", "512",
    "--max-num-seqs", "16",
    "--kv-cache-memory-bytes", str(1 << 20),
    "--api-key", API_KEY,
    "--served-model-name", "tiny-llama",
]  # fmt: skip
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Where the browser test also saves its screenshot under load (the docs' picture is made so).
SCREENSHOT_ENV = "PAGEDLLM_DASHBOARD_SCREENSHOT"


def _app(*flags: str) -> TestClient:
    """The app's routes only: the lifespan (and so the engine) never runs."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="unused")
    make_arg_parser(parser)
    args = parser.parse_args(list(flags))
    return TestClient(build_app(args), follow_redirects=False)


def test_disable_dashboard_removes_every_route():
    client = _app("--disable-dashboard")
    for path in ("/dashboard", "/dashboard/events", "/dashboard/static/dashboard.js"):
        assert client.get(path).status_code == 404


def test_without_api_key_the_page_and_its_files_are_open():
    client = _app()
    page = client.get("/dashboard")
    assert page.status_code == 200 and "dashboard/events" not in page.text
    assert 'src="dashboard/static/dashboard.js"' in page.text
    script = client.get("/dashboard/static/dashboard.js")
    assert script.status_code == 200 and "text/javascript" in script.headers["content-type"]
    uplot = client.get("/dashboard/static/vendor/uPlot.iife.min.js")
    assert uplot.status_code == 200 and "uPlot" in uplot.text
    assert client.get("/dashboard/static/../routes.py").status_code == 404
    assert client.get("/dashboard/static/nothing.js").status_code == 404


def test_api_key_login_sets_a_cookie_that_opens_the_dashboard():
    client = _app("--api-key", API_KEY)
    page = client.get("/dashboard")
    assert page.status_code == 401 and 'name="api_key"' in page.text  # the login form
    assert client.get("/dashboard/static/dashboard.js").status_code == 401
    assert client.get("/dashboard/events").status_code == 401
    assert client.get("/dashboard/static/dashboard.js", headers=AUTH).status_code == 200

    wrong = client.post("/dashboard/login", data={"api_key": "nope"})
    assert wrong.status_code == 401 and "Wrong API key" in wrong.text
    assert COOKIE_NAME not in wrong.cookies

    ok = client.post("/dashboard/login", data={"api_key": API_KEY})
    assert ok.status_code == 303 and ok.headers["location"] == "../dashboard"
    cookie = ok.cookies[COOKIE_NAME]
    assert cookie == dashboard_token(API_KEY) and API_KEY not in cookie
    set_cookie = ok.headers["set-cookie"].lower()
    assert "httponly" in set_cookie and "samesite=strict" in set_cookie
    client.cookies.set(COOKIE_NAME, cookie)
    assert client.get("/dashboard").status_code == 200
    assert client.get("/dashboard/static/dashboard.css").status_code == 200
    # /v1 still wants the header: the cookie opens the dashboard only.
    assert client.get("/v1/models").status_code == 401


def test_stat_logger_ticks_rates_percentiles_and_step_split():
    lg = DashboardStatLogger(0, window_s=10.0)
    start = lg._last_tick
    it = IterationStats(num_generation_tokens=30, num_prompt_tokens=100)
    it.time_to_first_tokens += [0.1, 0.2, 0.3, 0.4]
    it.inter_token_latencies += [0.01] * 99 + [0.5]
    lg.record(SchedulerStats(num_running_reqs=3, kv_cache_usage=0.25), it)
    lg.record_snapshot(EngineSnapshot(0.0, 4, b"\x00\x01\x02\x00", num_steps=5,
                                      step_times=(0.001, 0.002, 0.0005, 0.0001)))  # fmt: skip
    point = dict(zip(POINT_FIELDS, lg.tick(1234.0, start + 2.0)))
    assert point["t"] == 1234.0
    assert point["gen_tps"] == pytest.approx(15.0) and point["prompt_tps"] == pytest.approx(50.0)
    assert point["ttft_p50"] == pytest.approx(200.0) and point["ttft_p99"] == pytest.approx(400.0)
    assert point["itl_p50"] == pytest.approx(10.0) and point["itl_p99"] == pytest.approx(10.0)
    assert (point["sched_ms"], point["model_ms"]) == pytest.approx((1.0, 2.0))
    assert (point["kv_usage"], point["running"]) == (0.25, 3)
    state = lg.current(0.0)
    assert base64.b64decode(state["blocks"]) == b"\x00\x01\x02\x00"
    # The next second: no tokens, no new steps (a gap), latencies still in the window;
    # past the window they are gone.
    quiet = dict(zip(POINT_FIELDS, lg.tick(1235.0, start + 3.0)))
    assert quiet["gen_tps"] == 0 and quiet["model_ms"] is None and quiet["ttft_p50"] is not None
    late = dict(zip(POINT_FIELDS, lg.tick(1250.0, start + 20.0)))
    assert late["ttft_p50"] is None and late["itl_p99"] is None
    assert len(lg.history) == 3


def test_percentile_is_nearest_rank():
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile(list(range(1, 101)), 0.99) == 99


# ---- a live server ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with RemoteServer(tiny_llama_dir, ARGS) as srv:
        yield srv


@contextmanager
def load(url: str, threads: int = 12, ids: set[str] | None = None) -> Iterator[threading.Event]:
    """Completions back to back from `threads` clients until the block ends (their response
    ids added to `ids`)."""
    stop = threading.Event()
    errors: list[str] = []

    def client(i: int) -> None:
        with httpx.Client(headers=AUTH, timeout=120) as http:
            n = 0
            while not stop.is_set():
                words = " ".join(f"w{i}-{n}-{k}" for k in range(8 + 7 * (n % 5)))
                body = {"prompt": words, "max_tokens": 48, "ignore_eos": True}
                r = http.post(f"{url}/v1/completions", json=body)
                if r.status_code != 200:
                    errors.append(r.text)
                elif ids is not None:
                    ids.add(r.json()["id"])
                n += 1

    workers = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    try:
        yield stop
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert not errors, errors[:3]


def _events(url: str, count: int) -> Iterator[tuple[str, dict]]:
    """The first `count` events of the SSE stream: (event name, data)."""
    with httpx.stream("GET", f"{url}/dashboard/events", headers=AUTH, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        event = "message"
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                yield event, json.loads(line[6:])
                event = "message"
                count -= 1
                if count == 0:
                    return


def _in_use(engine: dict) -> int:
    return base64.b64decode(engine["blocks"]).count(1)


@pytest.mark.slow
def test_event_stream_follows_a_load_and_settles(server):
    events = _events(server.url, 1000)
    name, init = next(events)
    assert name == "init"
    assert init["config"]["block_size"] == 16 and init["config"]["max_num_seqs"] == 16
    fields = init["fields"]
    ids: set[str] = set()
    with load(server.url, ids=ids):
        busy = []
        for _, update in events:
            (engine,) = update["engines"]
            point = dict(zip(fields, engine["point"]))
            if "blocks" in engine and engine["requests"] and point["gen_tps"] > 0:
                busy.append((engine, point))
            if len(busy) == 3:
                break
    engine, point = busy[-1]
    assert engine["health"] == "ok"
    assert _in_use(engine) > 0 and engine["kv_usage"] > 0
    assert {r[1] for r in engine["requests"]} <= {"RUNNING", "WAITING", "PREEMPTED"}
    # Requests are named as their callers know them: the response id, "-<prompt index>".
    shown = [r[0] for e, _ in busy for r in e["requests"]]
    assert all(s.rsplit("-", 1)[0] in ids and s.rsplit("-", 1)[1].isdigit() for s in shown), shown
    assert any(p["model_ms"] is not None and p["model_ms"] > 0 for _, p in busy)
    assert any(p["ttft_p50"] is not None for _, p in busy)
    assert len({e["blocks"] for e, _ in busy}) > 1, "the block map moves under load"
    # Once the load ends, the engine idles: nothing in use, no tokens, no requests.
    for _, update in events:
        (engine,) = update["engines"]
        point = dict(zip(fields, engine["point"]))
        if point["gen_tps"] == 0 and not engine["requests"] and engine["running"] == 0:
            break
    assert _in_use(engine) == 0
    assert base64.b64decode(engine["blocks"]).count(2) > 0, "finished prompts stay cached"
    events.close()


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.mark.slow
def test_page_in_a_browser_moves_under_load_and_settles(server, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install -e '.[browser]'")
    chromium = _chromium()
    if chromium is None:
        pytest.skip("no chromium on PATH (make test installs Debian's chromium as root)")
    errors: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1150})
            login = page.goto(f"{server.url}/dashboard")
            assert login.status == 401  # the login form (the browser logs the 401 itself)
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.fill("#api_key", API_KEY)
            page.click("button[type=submit]")
            page.wait_for_function("window.pagedllmDashboard && pagedllmDashboard.ticks >= 1")
            assert page.inner_text("#model") != ""

            blocks = "document.getElementById('block-map').toDataURL()"
            last_gen = "(() => { const v = pagedllmDashboard, c = v.series[v.engine]; "
            last_gen += "const g = c[v.fields.indexOf('gen_tps')]; return g[g.length - 1]; })()"
            with load(server.url):
                page.wait_for_function(f"{last_gen} > 0", timeout=20_000)
                seen = {page.evaluate(blocks)}
                for _ in range(3):
                    ticks = page.evaluate("pagedllmDashboard.ticks")
                    page.wait_for_function(f"pagedllmDashboard.ticks > {ticks}")
                    seen.add(page.evaluate(blocks))
                assert len(seen) > 1, "the block map changes under load"
                # The clients run in near lockstep, so a tick can fall between one round of
                # their requests and the next: wait for a tick that shows some in flight.
                page.wait_for_function(
                    "document.querySelectorAll('#requests tbody tr').length > 0", timeout=20_000
                )
                shot = page.screenshot(full_page=True)
                assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 20_000
                target = os.environ.get(SCREENSHOT_ENV)
                if target:
                    Path(target).write_bytes(shot)
            # Settled: no tokens, no requests, a block map that no longer changes.
            page.wait_for_function(
                f"{last_gen} === 0 && pagedllmDashboard.latest[0].running === 0", timeout=20_000
            )
            assert page.locator("#requests tbody tr").count() == 0
            settled = page.evaluate(blocks)
            ticks = page.evaluate("pagedllmDashboard.ticks")
            page.wait_for_function(f"pagedllmDashboard.ticks > {ticks + 1}")
            assert page.evaluate(blocks) == settled
            assert page.inner_text("#health") == "healthy"
        finally:
            browser.close()
    assert errors == [], errors


@pytest.mark.slow
def test_an_open_page_does_not_hold_up_shutdown(server):
    """Last in this module: it stops the server. The stream ends at the next tick after
    SIGTERM instead of being cut at --timeout-graceful-shutdown."""
    with httpx.stream("GET", f"{server.url}/dashboard/events", headers=AUTH, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines) == "event: init"
        server.proc.send_signal(signal.SIGTERM)
        for _ in lines:  # returns when the server ends the stream
            pass
    assert server.proc.wait(timeout=60) is not None
    assert "timeout graceful shutdown exceeded" not in server.logs()
