"""A model's files as the engine finds them: the directory (or GGUF file, or the built-in
demo) a model name means, and the default sampling params of its generation_config.json. Host
only."""

import json
import logging
from pathlib import Path
from typing import Any

from jaxserve.request import SamplingParams

log = logging.getLogger("jaxserve")
DEMO = "demo"


def resolve_model(model: str | Path | None) -> Path:
    """A local model directory; None or "demo" is the built-in demo model."""
    if model is None or str(model) == DEMO:
        from jaxserve.demo import demo_model_dir

        return demo_model_dir()
    path = Path(model)
    if not (path.is_dir() or (path.is_file() and path.suffix == ".gguf")):
        raise ValueError(f"model {str(model)!r} is not a local model directory or GGUF file "
                         f"(nothing is downloaded; pass a Hugging Face directory, a .gguf file "
                         f"or {DEMO!r})")
    return path


# generation_config.json keys that become default sampling params (as vLLM's
# generation_config="auto"), and those jaxserve's sampler does not have: the default is dropped
_GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                        "max_new_tokens": "max_tokens"}
_GENERATION_UNSUPPORTED = {"repetition_penalty": 1.0, "min_p": 0.0}


def generation_defaults(path: str | Path) -> dict[str, Any]:
    """The model's default sampling params from its generation_config.json: temperature, top_p,
    top_k, max_tokens (as vLLM takes them when a request leaves them out). A value the sampler
    would refuse, or one it has no equivalent for, is left out with a warning."""
    file = Path(path) / "generation_config.json"
    try:
        data = json.loads(file.read_text()) if file.is_file() else {}
    except json.JSONDecodeError:
        data = {}
    data = data if isinstance(data, dict) else {}
    defaults = {}
    for key, name in _GENERATION_DEFAULTS.items():
        if data.get(key) is None:
            continue
        try:
            SamplingParams(**{name: data[key]})
        except (ValueError, TypeError) as error:
            log.warning("%s: ignoring %s (%s)", file, key, error)
            continue
        defaults[name] = data[key]
    for key, neutral in _GENERATION_UNSUPPORTED.items():
        if data.get(key) not in (None, neutral):
            log.warning("%s: %s %s is not supported by jaxserve's sampler; sampling without it",
                        file, key, data[key])
    return defaults
