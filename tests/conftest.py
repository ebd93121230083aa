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

# the server tests' engine: few buckets, so start-up compiles little; the CLI tests pass the
# same flags, so their subprocesses find every step in the persistent compilation cache
SERVER_ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=128, prefill_chunk_sizes=(32,),
                     page_size=8, num_pages=256, enable_prompt_logprobs=False)
SERVER_ENGINE_FLAGS = ["--max-num-seqs", "8", "--max-num-batched-tokens", "128",
                       "--prefill-chunk-sizes", "32", "--page-size", "8", "--num-pages", "256",
                       "--no-enable-prompt-logprobs"]
