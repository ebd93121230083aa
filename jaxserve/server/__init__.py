"""The OpenAI-compatible HTTP server (Starlette + uvicorn) over an `AsyncEngine`."""

from jaxserve.server.app import bind, build_app, serve
from jaxserve.server.config import ServerConfig

__all__ = ["ServerConfig", "bind", "build_app", "serve"]
