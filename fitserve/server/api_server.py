"""`fitserve serve`: build the engine from the flags, wrap it in the app, serve it with uvicorn.

Shutdown contract: SIGINT or SIGTERM stops accepting connections, ends every in-flight request with
a final output (finish_reason "abort"; streams get their last chunk and `data: [DONE]`), stops the
engine (its thread, or its process) and returns, so the process exits with status 0 within a few
seconds. A second SIGINT forces the exit.

On a GPU the engine runs in a process of its own (fitserve/engine/engine_process.py), so that the HTTP
side's work never holds the GIL the engine's step launches wait for; on the CPU, and with
--disable-frontend-multiprocessing, it runs on a thread of this process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import gc
import importlib
import logging
import os
import resource
import signal
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from types import FrameType

import uvicorn

from fitserve.args import EngineArgs
from fitserve.args_support import refuse_replica_combinations
from fitserve.engine.async_engine import AsyncEngine
from fitserve.engine.data_parallel import DataParallelEngine, replica_visible_devices
from fitserve.engine.engine import Engine
from fitserve.engine.engine_process import EngineProcess
from fitserve.planner.memory import MemoryPlan
from fitserve.server import startup_gc
from fitserve.server.args import API_KEY_ENV_VARS, ServerSettings
from fitserve.structured import backend as structured_backend

logger = logging.getLogger(__name__)

# Seconds uvicorn waits for open connections after the in-flight requests were ended.
GRACEFUL_SHUTDOWN_TIMEOUT_S = 5
# Seconds after the server is up before xgrammar (~0.3 s of imports, holding the GIL) loads on a thread:
# neither the start nor a first request sent the moment /health answers pays for it, and a structured
# request that comes earlier imports it itself.
GRAMMAR_PRELOAD_DELAY_S = 1.0


class _Server(uvicorn.Server):
    """uvicorn's server with two changes: a shutdown signal also ends the engine's in-flight requests
    (uvicorn alone would wait for them to finish), and the signal is not raised again after a clean
    shutdown (uvicorn re-raises it, which would end the process with the signal's status, not 0)."""

    def __init__(
        self, config: uvicorn.Config, engine: AsyncEngine, base_url: str, auth_header: str = ""
    ) -> None:
        super().__init__(config)
        self.engine = engine
        self.base_url = base_url
        self.auth_header = auth_header
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine_stopping = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            freeze_startup_heap()
            _log_ready(self.engine, self.base_url, self.auth_header)
            self._loop.call_later(GRAMMAR_PRELOAD_DELAY_S, preload_grammar_backend)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True
        if not self._engine_stopping and self._loop is not None:
            self._engine_stopping = True
            logger.info("Received %s: shutting down", signal.Signals(sig).name)
            self._loop.call_soon_threadsafe(self.engine.begin_shutdown)


def freeze_startup_heap() -> None:
    """Move every object alive once the server is up (torch, the model's modules, the tokenizer: about
    300,000 of them) out of the garbage collector's reach, as vLLM does once its engine is built.

    A full collection walks every tracked object and holds the GIL meanwhile: 150 to 200 ms with the
    startup heap in it (docs/performance.md), during which the engine thread cannot launch a step.
    After the freeze it walks only what requests made since. None ran during a `bench serve` run of
    128 requests, but a long-lived server gets one whenever enough new objects have piled up.

    The collector, paused for the start (fitserve/server/startup_gc.py), runs again from here.
    """
    gc.collect()
    gc.freeze()
    startup_gc.resume()
    if logger.isEnabledFor(logging.DEBUG):  # the count walks every frozen object (~25 ms for 300,000)
        logger.debug("Froze %d startup objects out of the garbage collector's reach", gc.get_freeze_count())


def preload_grammar_backend() -> threading.Thread:
    """Imports the structured-output backend (xgrammar) on a thread, so the first constrained request
    does not import it on the event loop; returns the thread.

    Not a daemon: the interpreter waits for it before it finalizes. A daemon thread still inside
    xgrammar's C++ initialisation when a shutdown finalizes the interpreter aborts the process
    ("terminate called without an active exception", exit status 134: seen with SIGINT 0.85 s after
    /health answered)."""
    thread = threading.Thread(target=structured_backend.preload, name="fitserve-xgrammar-import")
    thread.start()
    return thread


def bind_socket(host: str, port: int) -> socket.socket:
    """Reserve the port before the model loads, so a busy port fails in a second, not after the load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(
            f"cannot listen on {host}:{port} ({exc.strerror}): stop what uses the port or pick another "
            "with --port"
        ) from exc
    sock.set_inheritable(True)
    return sock


def memory_line(plan: MemoryPlan, max_rss_bytes: int) -> str:
    """The startup "Memory:" line: the KV cache as the engine sized it (the planner's memory plan: bytes
    in the cache's own element type, the tokens requests can use, block 0 being reserved)."""
    return (
        f"Memory: KV cache {plan.kv_cache_gib_per_gpu:.2f} GiB ({plan.kv_cache_tokens} tokens in "
        f"{plan.num_kv_blocks} blocks of {plan.inputs.block_size}, one reserved), process peak RSS "
        f"{max_rss_bytes / 2**30:.2f} GiB"
    )


# The startup hint asks for a short answer: with no max_tokens a chat request may generate until the
# context is full (vLLM's semantics), minutes on a CPU.
HINT_MAX_TOKENS = 64


def _auth_header(api_key: str | None) -> str:
    """The curl option that sends the API key, for the startup hint: it names the environment variable
    the key came from, never the key itself."""
    if not api_key:
        return ""
    variable = next((name for name in API_KEY_ENV_VARS if os.environ.get(name) == api_key), None)
    key = f"${variable}" if variable else "<your --api-key>"
    return f' -H "Authorization: Bearer {key}"'


def _log_ready(engine: AsyncEngine, base_url: str, auth_header: str = "") -> None:
    model = engine.config.model
    max_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # the engine process's own peak (the model's weights are there), not the HTTP side's
    max_rss_bytes = getattr(engine.engine, "peak_rss_bytes", max_rss_bytes)
    logger.info("%s", memory_line(engine.engine.memory_plan, max_rss_bytes))
    from fitserve.server.app import ROUTES

    logger.info("Routes: %s", ", ".join(ROUTES))
    names = tuple(model.served_model_name) or (model.model,)
    logger.info(
        "Serving %s at %s/v1 (OpenAI-compatible). Try:\n  curl %s/v1/chat/completions "
        '-H \'Content-Type: application/json\'%s -d \'{"model": "%s", "messages": '
        '[{"role": "user", "content": "Hello!"}], "max_tokens": %d}\'',
        names[0],
        base_url,
        base_url,
        auth_header,
        names[0],
        HINT_MAX_TOKENS,
    )


def h11_options(settings: ServerSettings) -> dict[str, int]:
    """uvicorn's h11 limit when --h11-max-incomplete-event-size is given, else uvicorn's default."""
    size = settings.h11_max_incomplete_event_size
    return {} if size is None else {"h11_max_incomplete_event_size": size}


def use_engine_process(engine_args: EngineArgs, settings: ServerSettings) -> bool:
    """The engine runs in a process of its own on a GPU (where the GIL it shares with the HTTP side costs
    throughput); on the CPU, and with --disable-frontend-multiprocessing, on a thread of this process."""
    if settings.disable_frontend_multiprocessing or engine_args.device == "cpu":
        return False
    if engine_args.device == "cuda":
        return True
    import torch  # no CUDA context: the count comes from the driver

    return torch.cuda.is_available()


def create_engine(engine_args: EngineArgs, settings: ServerSettings) -> Engine | EngineProcess:
    if use_engine_process(engine_args, settings):
        # the server decodes logprob tokens in its handlers (see build_app)
        return EngineProcess.start(engine_args, serving=True, decode_logprob_tokens=False)
    return Engine.from_engine_args(engine_args, serving=True)


def create_replicas(engine_args: EngineArgs) -> list[EngineProcess]:
    """--data-parallel-size N: N engine processes, each on its own GPUs (engine/data_parallel.py), started
    side by side; one that fails to start stops the others."""
    refuse_replica_combinations(engine_args)
    size = engine_args.data_parallel_size
    one = dataclasses.replace(engine_args, data_parallel_size=1)
    visible: list[str | None] = [None] * size
    gpus = visible_gpus()
    if gpus:
        tp = engine_args.tensor_parallel_size if "tensor_parallel_size" in engine_args.explicit() else 0
        per_replica = tp or max(1, len(gpus) // size)
        visible = list(replica_visible_devices(size, per_replica, gpus))
    logger.info("Data parallel: %d engine replicas%s", size, "".join(f"; GPUs {v}" for v in visible if v))
    # each start loads its tokenizer on its own thread: transformers' lazy imports race when two threads
    # import it first at once (ImportError: cannot import name 'AutoTokenizer'), so it imports here once
    from transformers import AutoTokenizer  # noqa: F401

    with ThreadPoolExecutor(size, thread_name_prefix="fitserve-replica-start") as pool:
        start = functools.partial(EngineProcess.start, one, serving=True, decode_logprob_tokens=False)
        starting = [pool.submit(start, visible_devices=devices) for devices in visible]
        wait(starting)
    replicas = [future.result() for future in starting if future.exception() is None]
    errors = [future.exception() for future in starting if future.exception() is not None]
    if errors:
        for replica in replicas:
            replica.stop()
        raise errors[0]
    return replicas


def visible_gpus() -> list[str]:
    """The GPUs this process sees, as CUDA_VISIBLE_DEVICES entries (its own list, else indices); none on
    a machine without CUDA."""
    import torch  # no CUDA context: the count comes from the driver

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    listed = [entry for entry in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    return (listed or [str(index) for index in range(count)])[:count]


def run_server(engine_args: EngineArgs, namespace: argparse.Namespace) -> None:
    """Serve until SIGINT/SIGTERM; `namespace` holds the server flags. Bad flags raise ValueError before
    anything loads."""
    settings = ServerSettings.from_namespace(namespace)
    if settings.exposed_without_key:
        logger.warning(
            "Listening on %s without an API key: anyone who can reach this machine can use the server. "
            "Set --api-key (or FITSERVE_API_KEY), or bind to 127.0.0.1.",
            settings.host,
        )
    sock = bind_socket(settings.host, settings.port)
    # The web app's modules (fastapi, pydantic's models, jinja2: about a second on a small CPU) import on a
    # thread while the model loads; build_app below waits for them if they are not in yet.
    app_modules = threading.Thread(
        target=importlib.import_module, args=("fitserve.server.app",), name="fitserve-app-import", daemon=True
    )
    app_modules.start()
    engine: Engine | EngineProcess | None = None
    replicas: list[EngineProcess] = []
    try:
        with _sigterm_as_interrupt():
            if engine_args.data_parallel_size > 1:
                replicas = create_replicas(engine_args)
            else:
                engine = create_engine(engine_args, settings)
        async_engine: AsyncEngine | DataParallelEngine
        if replicas:
            log_stats = not replicas[0].config.disable_log_stats
            async_engine = DataParallelEngine([AsyncEngine(r, log_stats=log_stats) for r in replicas])
        else:
            async_engine = AsyncEngine(engine, log_stats=not engine.config.disable_log_stats)
        from fitserve.server.app import build_app

        app = build_app(async_engine, settings)
        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level=settings.uvicorn_log_level,
            access_log=not settings.disable_uvicorn_access_log,
            root_path=settings.root_path or "",
            ssl_keyfile=settings.ssl_keyfile,
            ssl_certfile=settings.ssl_certfile,
            ssl_ca_certs=settings.ssl_ca_certs,
            ssl_cert_reqs=settings.ssl_cert_reqs,
            **({} if settings.ssl_ciphers is None else {"ssl_ciphers": settings.ssl_ciphers}),
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_TIMEOUT_S,
            **h11_options(settings),
        )
        _Server(config, async_engine, settings.base_url, _auth_header(settings.api_key)).run(sockets=[sock])
    except KeyboardInterrupt:
        logger.info("Interrupted while starting: exiting")
    finally:
        startup_gc.resume()  # a start that failed never reached freeze_startup_heap
        sock.close()
        for process in [engine, *replicas]:
            if isinstance(process, EngineProcess):  # already stopped, unless the server failed to start
                process.stop()


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """While the model loads, SIGTERM stops the start like Ctrl-C does (uvicorn handles it later)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
