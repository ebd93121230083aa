"""The OpenAI-compatible HTTP server (Starlette + uvicorn) over an `AsyncEngine`."""

from jaxserve.server.app import ServerConfig, build_app, serve

__all__ = ["ServerConfig", "build_app", "serve"]
