"""The server inside a process that already runs a generator: the RL run's agent endpoint.

``AgentEndpoint`` serves a running ``orchestrator.Generator`` (the run's own: the same slots, weights and policy
versions as every other rollout) with the routes of ``serve/app.py`` plus the agent-session routes, from uvicorn
on a daemon thread with its own event loop, on a socket bound before the thread starts (port 0: an ephemeral
port; the address is known when ``start`` returns). Every request needs the endpoint's API key (a random one
unless given). ``stop`` shuts uvicorn down within ``timeout_s``.
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
import socket
import threading
import time
from typing import Any, Sequence

from jaxrl_async.serve.backend import ServeBackend
from jaxrl_async.serve.sessions import SessionStore

__all__ = ["AgentEndpoint", "is_loopback"]

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class AgentEndpoint:
    """An OpenAI-compatible endpoint with agent sessions on ``generator`` (module docstring).

    Args:
      generator: a started in-process ``orchestrator.Generator``.
      tokenizer: the model's tokenizer (chat template).
      eos_ids: stop token ids of the run (``RunSetup.eos_ids``).
      host, port: where to listen (port 0: any free port). Not a loopback address only with ``api_key``.
      api_key: the key every request must carry (default: a random one, see ``api_key``).
      model_name: the served model name.
      request_timeout_s: the longest a single call may take.
      default_max_tokens: new tokens of a call that sets no ``max_tokens`` (the run's ``rollout.sampling``).
    """

    def __init__(self, generator: Any, tokenizer: Any, *, eos_ids: Sequence[int] = (), host: str = "127.0.0.1",
                 port: int = 0, api_key: str | None = None, model_name: str = "policy",
                 request_timeout_s: float = 600.0, max_queue: int = 1024, default_max_tokens: int | None = None):
        if not is_loopback(host) and not api_key:
            raise ValueError(f"the agent endpoint binds to {host!r}, not a loopback address: give it an API key")
        engine = getattr(generator, "engine", None)
        if engine is None or not hasattr(generator, "num_slots"):
            raise ValueError("the openai_agent workflow needs the run's generator in this process (a multi-process "
                             "run's remote generators are not supported yet)")
        self.api_key = api_key or secrets.token_urlsafe(24)
        self.sessions = SessionStore()
        vocab = getattr(getattr(engine, "cfg", None), "vocab_size", None) or len(tokenizer)
        self.backend = ServeBackend(generator, tokenizer, model_name=model_name, vocab_size=vocab,
                                    eos_ids=eos_ids, max_queue=max_queue, request_timeout_s=request_timeout_s,
                                    default_max_tokens=default_max_tokens)
        self.backend.recorders.append(self.sessions.record)
        self.host, self._port = host, int(port)
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.address: tuple[str, int] | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` (no trailing slash)."""
        if self.address is None:
            raise RuntimeError("AgentEndpoint.start() has not run")
        host, port = self.address
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    def session_url(self, sid: str) -> str:
        """The OpenAI base URL of session ``sid``."""
        return f"{self.url}/sessions/{sid}/v1"

    def start(self, timeout_s: float = 30.0) -> "AgentEndpoint":
        import uvicorn

        from jaxrl_async.serve.app import build_app

        app = build_app(self.backend, api_key=self.api_key, sessions=self.sessions)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self._port))
        sock.listen(256)
        self.address = sock.getsockname()[:2]
        cfg = uvicorn.Config(app, log_level="warning", timeout_keep_alive=30, timeout_graceful_shutdown=5,
                             lifespan="off")
        self._server = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="agent-endpoint",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the agent endpoint's server exited while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the agent endpoint did not start within {timeout_s} s")
            time.sleep(0.01)
        log.info("agent endpoint: %s", self.url)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is None:
            return
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self._server.force_exit = True
                self._thread.join(2.0)
        self._server = None
