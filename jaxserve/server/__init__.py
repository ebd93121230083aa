"""The OpenAI-compatible HTTP server (Starlette + uvicorn) over an `AsyncEngine`: routes, SSE,
the request fields and their checks, the error envelope, metrics, connection limits.

Imports the engine and what it stands on (config, request, text, parallel's process group);
never the runner or the model directly. Only the CLI and the tools import it.
"""

from jaxserve.server.app import bind, build_app, serve
from jaxserve.server.config import ServerConfig

__all__ = ["ServerConfig", "bind", "build_app", "serve"]
