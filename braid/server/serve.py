"""`braid serve`: the API process. It starts the engine process (which starts the ranks), loads
the tokenizer meanwhile, then serves HTTP with uvicorn until a signal or a dead engine.

SIGINT or SIGTERM: stop accepting connections, give in-flight requests `shutdown_timeout`
seconds to finish, abort the rest (their streams end with finish reason "abort"), stop the
engine, its ranks and their shared memory; exit code 0. A dead engine (a rank died) fails every
waiting request and ends the server with exit code 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from braid.config import EngineConfig
from braid.loader.model_config import check_model_path
from braid.loader.tokenizer import eos_token_ids, load_tokenizer
from braid.server import embeddings, reasoning
from braid.server.api import ServerContext, build_app
from braid.server.async_engine import AsyncEngine
from braid.server.metrics import Metrics
from braid.server.responses_api import ResponseStore
from braid.server.settings import ServeSettings
from braid.server.tool_calls import parser_for


class _Server(uvicorn.Server):
    """uvicorn, with braid's shutdown: on the first SIGINT/SIGTERM, in-flight requests get the
    grace period, then are aborted. Unlike uvicorn's default, the signal is not raised again
    once the server has stopped, so a clean shutdown exits with 0."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace_s: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.grace_s = grace_s
        self.loop: asyncio.AbstractEventLoop | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with _signals_call(self.handle_exit):
            yield

    def handle_exit(self, sig: int, frame) -> None:
        if not self.should_exit and self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.call_later, self.grace_s,
                                           self.engine.abort_all)
        super().handle_exit(sig, frame)


class _Stopped(Exception):
    """SIGINT or SIGTERM while the server starts."""


def _raise_stopped(*_) -> None:
    """SIGINT or SIGTERM during start-up (loading, compiling: minutes, cold): a stop as clean
    as one asked for later."""
    raise _Stopped


@contextlib.contextmanager
def _signals_call(handler) -> Iterator[None]:
    """While inside, SIGINT and SIGTERM call `handler`."""
    handled = (signal.SIGINT, signal.SIGTERM)
    originals = {sig: signal.signal(sig, handler) for sig in handled}
    try:
        yield
    finally:
        for sig, original in originals.items():
            signal.signal(sig, original)


def served_name(model: str) -> str:
    """The model's name in the API: its GGUF file's stem or its folder's name."""
    path = Path(model)
    return path.stem if path.is_file() else path.resolve().name


def run_server(config: EngineConfig, settings: ServeSettings) -> int:
    """Serve until stopped; the process exit code (0 after a signal, 1 if the engine died)."""
    api_key, chat_template = settings.key(), settings.chat_template_text()
    check_model_path(config.model)  # a clear error before any process starts
    engine = AsyncEngine(config)
    try:
        try:
            with _signals_call(_raise_stopped):
                # the tokenizer while the engine loads the model
                tokenizer = load_tokenizer(config.model, config.cache)
                if chat_template is not None:
                    tokenizer.chat_template = chat_template
                model_config = engine.wait_ready()
        except _Stopped:
            return 0  # a stop asked for before the server was up: the engine stops below
        metrics = Metrics()
        ctx = ServerContext(
            engine=engine, tokenizer=tokenizer, model_config=model_config,
            model_name=settings.served_model_name or served_name(config.model),
            model_path=config.model,
            kv_capacity=config.kv_cache.capacity_tokens,
            eos_token_ids=eos_token_ids(model_config, tokenizer), metrics=metrics,
            api_key=api_key, api_key_all_routes=settings.api_key_all_routes,
            limits=settings.limits, report_cached_tokens=settings.report_cached_tokens,
            tool_parser=parser_for(settings.tool_call_parser,
                                   getattr(tokenizer, "chat_template", None)),
            reasoning_parser=reasoning.parser_for(settings.reasoning_parser,
                                                  getattr(tokenizer, "chat_template", None)),
            response_store=ResponseStore(settings.responses_store_size),
            pooling=(embeddings.checkpoint_pooling(config.model) if settings.pooling == "auto"
                     else settings.pooling),
            matryoshka_dimensions=embeddings.matryoshka_dimensions(config.model),
            created=int(time.time()))
        metrics.queued.set_function(lambda: engine.queued_sequences)
        server = _Server(uvicorn.Config(build_app(ctx), host=settings.host, port=settings.port,
                                        log_level=settings.log_level,
                                        limit_concurrency=settings.limit_concurrency,
                                        timeout_graceful_shutdown=settings.shutdown_timeout + 2),
                         engine, settings.shutdown_timeout)
        exit_code = 0

        def engine_died(reason: str) -> None:
            nonlocal exit_code
            exit_code = 1
            print(f"error: {reason}", file=sys.stderr, flush=True)
            server.should_exit = True

        async def serve() -> None:
            server.loop = asyncio.get_running_loop()
            engine.on_stats = metrics.update_engine
            engine.on_dead = engine_died
            engine.start(server.loop)
            await server.serve()

        asyncio.run(serve())
        return exit_code
    finally:
        engine.close()
        # The process ends now. Python's last collections over its heap (FastAPI's and
        # transformers' modules) took about a second of the stop; the OS frees it at once.
        gc.freeze()
