"""Shared fixtures: where the shared test models live."""

import os
from pathlib import Path

import pytest


def shared_dir() -> Path:
    """`JAXSERVE_SHARED_DIR`, else the `shared/` folder beside the repository."""
    env = os.environ.get("JAXSERVE_SHARED_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    """The stories260K model directory; skipped when absent, except under CI where it fails."""
    path = shared_dir() / "models" / "stories260K"
    if not (path / "tokenizer.json").is_file():
        message = f"shared model missing: {path} (set JAXSERVE_SHARED_DIR)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


HF_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"
HF_MODELS = ("llama", "llama3", "qwen2", "mistral")
