"""The dashboard's routes: `/dashboard` (the page), `/dashboard/static/*` (its script, style
and the vendored uPlot, shipped in the package), `/dashboard/events` (SSE, one update a
second) and `/dashboard/login`.

With `--api-key`, every dashboard route wants the key. A browser cannot put a header on a page
load, so the page accepts, besides `Authorization: Bearer KEY` (scripts), a cookie: without
it, `/dashboard` answers 401 with a one-field login form; the form posts the key to
`/dashboard/login`, which checks it and sets `pagedllm_dashboard` to an HMAC of the key (never
the key itself; HttpOnly, SameSite=Strict, Secure under TLS) and redirects to the page. The
key never rides in a URL, so it stays out of access logs and browser history.
"""

from __future__ import annotations

import hashlib
import hmac
from http import HTTPStatus
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse

from pagedllm.entrypoints.openai.errors import OpenAIError, error_response

COOKIE_NAME = "pagedllm_dashboard"
_STATIC = resources.files("pagedllm.entrypoints.dashboard") / "static"
_MEDIA_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}
_LOGIN_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>pagedllm dashboard: sign in</title>
<link rel="icon" href="data:,">
<style>body{font:15px system-ui,sans-serif;background:#111827;color:#e5e7eb;display:grid;
place-items:center;height:90vh}form{display:flex;gap:8px}input,button{font:inherit;
padding:6px 10px;border-radius:6px;border:1px solid #4b5563;background:#1f2937;color:inherit}
</style></head><body><form method="post" action="dashboard/login">
<label for="api_key">API key</label><input id="api_key" name="api_key" type="password"
autofocus required><button type="submit">Open the dashboard</button></form>%s</body></html>"""


def dashboard_token(api_key: str) -> str:
    """The cookie value for `api_key`: an HMAC, so the cookie does not hold the key."""
    return hmac.new(api_key.encode(), b"pagedllm-dashboard", hashlib.sha256).hexdigest()


def _authorized(request: Request, api_key: str | None) -> bool:
    if not api_key:
        return True
    given_header = request.headers.get("authorization", "")
    if hmac.compare_digest(given_header.encode(), f"Bearer {api_key}".encode()):
        return True
    cookie = request.cookies.get(COOKIE_NAME, "")
    return hmac.compare_digest(cookie.encode(), dashboard_token(api_key).encode())


def _unauthorized() -> Response:
    return error_response(
        OpenAIError(
            "Unauthorized: open /dashboard and sign in with the API key, or send "
            "Authorization: Bearer KEY",
            HTTPStatus.UNAUTHORIZED,
        )
    )


def _static_file(name: str) -> Response:
    """A file of the packaged `static/` folder (no path separators: nothing else is served)."""
    path = _STATIC.joinpath(*name.split("/"))
    if ".." in name.split("/") or not path.is_file():
        return error_response(OpenAIError(f"no dashboard file {name!r}", HTTPStatus.NOT_FOUND))
    suffix = name[name.rfind(".") :]
    return Response(path.read_bytes(), media_type=_MEDIA_TYPES.get(suffix, "text/plain"))


def register_dashboard_routes(app: FastAPI, api_key: str | None, secure_cookie: bool) -> None:
    """Add the dashboard's routes to `app` (`app.state.dashboard` is set by the lifespan)."""

    @app.get("/dashboard", include_in_schema=False)
    async def page(request: Request) -> Response:
        if not _authorized(request, api_key):
            return HTMLResponse(_LOGIN_PAGE % "", status_code=HTTPStatus.UNAUTHORIZED)
        return _static_file("index.html")

    @app.post("/dashboard/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        form = parse_qs((await request.body()).decode("utf-8", "replace"))
        given = (form.get("api_key") or [""])[0]
        if not api_key or not hmac.compare_digest(given.encode(), api_key.encode()):
            wrong = "<p role='alert'>Wrong API key.</p>" if api_key else ""
            return HTMLResponse(_LOGIN_PAGE % wrong, status_code=HTTPStatus.UNAUTHORIZED)
        # Relative: the page sits next to this route, whatever --root-path says.
        response = RedirectResponse("../dashboard", status_code=HTTPStatus.SEE_OTHER)
        response.set_cookie(
            COOKIE_NAME,
            dashboard_token(api_key),
            httponly=True,
            samesite="strict",
            secure=secure_cookie,
        )
        return response

    @app.get("/dashboard/static/{name:path}", include_in_schema=False)
    async def static(name: str, request: Request) -> Response:
        if not _authorized(request, api_key):
            return _unauthorized()
        return _static_file(name)

    @app.get("/dashboard/events", include_in_schema=False)
    async def events(request: Request) -> Response:
        if not _authorized(request, api_key):
            return _unauthorized()
        dashboard: Any = request.app.state.dashboard
        return StreamingResponse(
            dashboard.listen(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
