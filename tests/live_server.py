"""Run the real server (uvicorn) on 127.0.0.1 in a thread, over a fast tiny model that uses
the default model's real tokenizer and chat template: protocol tests without the wait."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from pathlib import Path

import uvicorn

from nanoinfer.loaders import LoadedModel
from nanoinfer.loaders.gguf import open_gguf
from nanoinfer.text.tokenizer import Tokenizer
from runtime.async_engine import AsyncEngine, engine_config
from runtime.serve.server_config import ServerConfig
from runtime.serve.server import create_app
from runtime.serve.serving import uvicorn_config
from tests.tiny import random_params, tiny_config


def tiny_chat_model(gguf_path: Path) -> LoadedModel:
    tokenizer = Tokenizer.from_gguf(open_gguf(gguf_path), gguf_path)
    cfg = tiny_config(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=96, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=2048)
    cfg = dataclasses.replace(cfg, eos_token_ids=tokenizer.eos_token_ids)
    return LoadedModel(cfg, random_params(cfg, seed=7), tokenizer, Path("tiny-chat"))


def start_in_thread(server: uvicorn.Server, thread: threading.Thread) -> str:
    """Start `thread` (running `server`), wait until it listens; its URL."""
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.01)
    return f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


class LiveServer:
    """`settings`: the ServerConfig fields a test changes (the app sees them as `nanoinfer
    serve` would; uvicorn here binds 127.0.0.1 on a free port whatever `host` says)."""

    def __init__(self, model: LoadedModel, engine_kw: dict | None = None, uvicorn_kw: dict | None = None,
                 **settings):
        config = engine_config(**{"num_blocks": 2048, "block_size": 16, **(engine_kw or {})})
        if config.data_parallel_size > 1 or settings.get("engine_process") == "on":
            from runtime.engine_process.data_parallel import data_parallel_from_loaded

            self.engine = data_parallel_from_loaded(model, config)
        else:
            self.engine = AsyncEngine(model, config)
        # (a module's client keeps its connection across tests: past serve's 5 s keep-alive, a request could meet
        # the server closing that connection and fail "Server disconnected without sending a response", as CI saw)
        server_config = ServerConfig(**{"served_model_name": "tiny-chat", "timeout_keep_alive": 600, **settings})
        self.app = create_app(self.engine, server_config)
        # (uvicorn as `nanoinfer serve` runs it: the same protocols, limits and loop)
        config = uvicorn_config(self.app, server_config, host="127.0.0.1", port=0, log_level="warning",
                                lifespan="on", **(uvicorn_kw or {}))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.url = start_in_thread(self.server, self.thread)
        return self

    def call(self, coro, timeout: float = 60):
        """Run `coro` on the server's event loop, where its engine runs; its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.engine._loop).result(timeout)

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
