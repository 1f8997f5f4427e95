"""Errors the front end raises about the engine core it talks to."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The EngineCore process has died (crashed, killed, or failed to answer).

    Raised to every pending and every new request; the engine cannot recover, so the server
    answers 503 until it is restarted.
    """

    def __init__(self, message: str = "") -> None:
        text = "EngineCore encountered an issue and is no longer running. See the logs above."
        super().__init__(f"{text} {message}".strip())


class EngineGenerateError(RuntimeError):
    """One request failed for a reason other than a dead engine or bad input."""
