"""The OpenAI-compatible HTTP server (Starlette + uvicorn) over an `AsyncEngine`."""

from jaxserve.server.app import ServerConfig, bind, build_app, serve

__all__ = ["ServerConfig", "bind", "build_app", "serve"]
