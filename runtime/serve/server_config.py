"""The server's settings, each declared once (nanoinfer/settings.py): the `nanoinfer serve` flag,
the keyword argument, the check and the help text that `nanoinfer serve --help` shows."""

from __future__ import annotations

from dataclasses import dataclass

from nanoinfer.sampling.sampling_params import MAX_N
from nanoinfer.settings import check_settings, setting

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]", "::1")
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ServerConfig:
    """What `nanoinfer serve` and `create_app` take: binding, access, limits, timeouts, logging."""

    host: str = setting("127.0.0.1", "address to bind (loopback only unless you say otherwise)")
    port: int = setting(8000, "port to bind (0 picks a free one)", minimum=0, maximum=65535)
    api_key: str | None = setting(None, "require `Authorization: Bearer KEY` on /v1/*", optional=True)
    served_model_name: str | None = setting(None, "the model id clients use (default: the model's short name or "
                                                  "file stem)", optional=True)
    cors_origin: tuple[str, ...] = setting((), "allow this origin (repeatable; CORS is off without it): its pages "
                                               "may call the API and open the WebSocket", repeated=True)
    allowed_hosts: tuple[str, ...] = setting((), "also answer this Host name (repeatable; '*': any). Without it a "
                                                 "loopback server answers only loopback names, another any name",
                                             repeated=True)
    max_pending: int = setting(1024, "sequences (prompts x n) in flight, waiting or running, before new "
                                     "requests get 503", minimum=1)
    max_n: int = setting(16, "largest n (completions per prompt) a request may ask for", minimum=1, maximum=MAX_N)
    max_body_bytes: int = setting(1 << 20, "largest request body (and WebSocket message)", minimum=1, size=True)
    log_level: str = setting("info", "info: a line per request and a throughput line; warning: quiet",
                             choices=LOG_LEVELS)
    log_interval: float = setting(10.0, "seconds between throughput lines while busy (at --log-level info)", above=0)
    timeout_keep_alive: int = setting(5, "seconds an idle keep-alive connection stays open", minimum=1)
    timeout_headers: float = setting(10.0, "seconds a client may take to send a request's headers", above=0)
    timeout_body: float = setting(30.0, "seconds a client may take to send a request's body (then 408)", above=0)
    shutdown_timeout: float = setting(20.0, "seconds SIGINT/SIGTERM lets requests in flight finish (new ones get "
                                            "503) before ending the rest with an error", minimum=0)
    max_header_bytes: int = setting(16384, "largest request head (line and headers) held while it arrives",
                                    minimum=1024, size=True)
    engine_process: str = setting("auto", "on: the engine steps in a process of its own, the HTTP front in this "
                                          "one (no interpreter lock shared: the faster under many streams); off: "
                                          "both in this process; auto: on with CUDA, off on the CPU. "
                                          "--data-parallel-size N > 1 runs N such processes",
                                  choices=("auto", "on", "off"))
    api_server_count: int = setting(1, "HTTP front processes serving the port over the same engine (vLLM's name): "
                                       "past a few hundred streams one front is a core's work. N > 1 runs the "
                                       "engine in a process of its own (--engine-process on)", minimum=1, maximum=64)
    stream_interval: int = setting(1, "tokens a stream gathers before its next SSE chunk (vLLM's name; its first "
                                      "token and its end go at once): above 1, fewer writes per token for a front "
                                      "serving hundreds of streams, at the cost of a smoother stream", minimum=1)

    def __post_init__(self):
        check_settings(self)


def allowed_hosts(config: ServerConfig) -> tuple[str, ...] | None:
    """The Host names the server answers (None: any). A loopback server answers loopback names;
    with --allowed-hosts, those too, and the address it is bound to."""
    if "*" in config.allowed_hosts or (config.host not in LOOPBACK_HOSTS and not config.allowed_hosts):
        return None
    bound = () if config.host in LOOPBACK_HOSTS or config.host in ("0.0.0.0", "::", "") else (config.host,)
    return (*LOOPBACK_HOSTS, *bound, *config.allowed_hosts)
