"""Starting the engine's own processes (the engine core, the workers): the environment they
start with, keeping `spawn` from re-running the user's script, and a free port to meet on."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from collections.abc import Iterator

# glibc malloc settings for the processes that run the model: keep freed chunks up to 32 MiB in
# the heap and never trim it, so the model's large per-layer temporaries are reused instead of
# being mmap'd, page-faulted and unmapped again on every layer (3x fewer page faults on CPU
# prefill; see BENCHMARKS.md). A user's own GLIBC_TUNABLES wins.
ENGINE_GLIBC_TUNABLES = (
    "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=17179869184"
)


@contextlib.contextmanager
def model_process_env() -> Iterator[None]:
    """Environment a spawned engine or worker process starts with (spawn copies os.environ)."""
    if "GLIBC_TUNABLES" in os.environ:
        yield
        return
    os.environ["GLIBC_TUNABLES"] = ENGINE_GLIBC_TUNABLES
    try:
        yield
    finally:
        os.environ.pop("GLIBC_TUNABLES", None)


@contextlib.contextmanager
def main_module_hidden(keep_for: type | None = None) -> Iterator[None]:
    """Keep `spawn` from re-running the user's `__main__` in a child process.

    The engine's processes need nothing from `__main__` (their targets and the config live in
    importable modules), and re-running it would start a second engine from a script that
    builds an `LLM` at top level without an `if __name__ == "__main__":` guard. A class
    `keep_for` defined in `__main__` (a custom engine core) does need it, so it is left alone
    then."""
    main = sys.modules.get("__main__")
    if main is None or getattr(keep_for, "__module__", None) == "__main__":
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def get_open_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on `host` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def exit_process(code: int) -> None:
    """End a child process once its own clean-up is done, skipping interpreter finalization:
    garbage-collecting torch's and transformers' state there can take seconds on a busy
    machine, long enough for the parent to give up waiting and kill it. Logs and stdio are
    flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
