"""Starting the engine's own processes (the engine core, the workers): how they start (fork or
spawn), the environment they start with, keeping `spawn` from re-running the user's script,
and a free port to meet on."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

# glibc malloc settings for the processes that run the model: keep freed chunks up to 32 MiB in
# the heap and never trim it, so the model's large per-layer temporaries are reused instead of
# being mmap'd, page-faulted and unmapped again on every layer (3x fewer page faults on CPU
# prefill; see BENCHMARKS.md). A user's own GLIBC_TUNABLES wins.
_MMAP_THRESHOLD = 32 << 20
_TRIM_THRESHOLD = 16 << 30
ENGINE_GLIBC_TUNABLES = (
    f"glibc.malloc.mmap_threshold={_MMAP_THRESHOLD}:glibc.malloc.trim_threshold={_TRIM_THRESHOLD}"
)

# How engine-core processes start (`auto`, `fork` or `spawn`; see engine_start_method).
ENGINE_METHOD_ENV = "PAGEDLLM_ENGINE_MULTIPROC_METHOD"


def engine_start_method(device: str) -> str:
    """`fork` or `spawn` for this process's engine-core processes (`PAGEDLLM_ENGINE_MULTIPROC_METHOD`,
    default `auto`). A forked engine has torch and pagedllm imported already, which a spawned
    one spends ~1.5 s of CPU on before it can load the model, most of `LLM(...)`'s start-up.
    `auto` forks on Linux for the CPU device while this process runs no other Python thread
    (a thread caught mid-import would leave its module locks held in the child); otherwise,
    and for CUDA (which cannot be used again in a forked child), it spawns."""
    method = os.environ.get(ENGINE_METHOD_ENV, "auto")
    if method not in ("auto", "fork", "spawn"):
        raise ValueError(f"{ENGINE_METHOD_ENV}={method!r} must be 'auto', 'fork' or 'spawn'")
    if method != "auto":
        return method
    if sys.platform != "linux" or device != "cpu" or threading.active_count() > 1:
        return "spawn"
    return "fork"


def start_process(proc: multiprocessing.process.BaseProcess, method: str) -> None:
    """`proc.start()`; a fork is made from a new thread. GNU OpenMP keeps a thread pool per
    thread that has run a parallel region: a child forked from such a thread (here: the main
    thread after any multi-threaded torch op) hangs in its first parallel region, while a
    child forked from a thread that never ran one starts a pool of its own."""
    if method != "fork":
        proc.start()
        return
    errors: list[BaseException] = []

    def start() -> None:
        try:
            proc.start()
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=start, name="EngineFork")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def settle_forked_engine() -> None:
    """First thing in a forked engine process: undo what it inherited that a spawned one would
    not have. The parent's log handlers go (the engine's lines get their own label); its
    signal handlers go (a wakeup fd would forward this process's
    signals to the parent's event loop); the parent's objects leave the garbage collector's
    view (gc.freeze: they are never freed here, and scanning them would copy their pages);
    the malloc settings a spawned engine gets from GLIBC_TUNABLES are set by mallopt (glibc
    reads the variable only when a process starts); torch's thread count is what a fresh
    process would pick (OMP_NUM_THREADS, else the CPUs this process may use)."""
    signal.set_wakeup_fd(-1)
    root = logging.getLogger()  # the engine sets up its own, as a spawned one does
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for signum in signal.valid_signals():
        try:
            handler = signal.getsignal(signum)
        except (OSError, ValueError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
            signal.signal(signum, default)
    gc.freeze()
    if os.environ.get("GLIBC_TUNABLES") == ENGINE_GLIBC_TUNABLES:
        _set_malloc_thresholds()
    import torch

    try:
        threads = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(max(1, threads))


def _set_malloc_thresholds() -> None:
    """ENGINE_GLIBC_TUNABLES through mallopt (its int arguments cap the trim threshold at
    2 GiB, which is as good as never for the engine's temporaries)."""
    m_trim_threshold, m_mmap_threshold = -1, -3
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(m_mmap_threshold, _MMAP_THRESHOLD)
        libc.mallopt(m_trim_threshold, min(_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):  # not glibc
        pass


# Hooks to run once this process's engine processes have been started (after_engines_start).
_engine_start_hooks: list[Callable[[], Any]] = []


@contextlib.contextmanager
def after_engines_start(hook: Callable[[], Any]) -> Iterator[None]:
    """Run `hook` when the engine launcher has started its engine processes (engines_started),
    if it does so inside this block: work that needs a thread of its own (the tokenizer's
    load) waits for it, so that a fork never copies that thread mid-work."""
    _engine_start_hooks.append(hook)
    try:
        yield
    finally:
        _engine_start_hooks.remove(hook)


def engines_started() -> None:
    """Called by the launcher once its engine processes are started."""
    for hook in list(_engine_start_hooks):
        hook()


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
