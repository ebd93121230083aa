"""The built-in demo model: a small byte-level Llama trained by `jaxserve.demo.train` on the
Python standard library's source, shipped in the package so `LLM()` and `jaxserve serve` work
offline with no model download.

Imports nothing here (the checkpoint's paths); train.py imports the model, the backends and
text. Must never import the engine or anything above it: the engine and the simulator find
the checkpoint here.
"""

from pathlib import Path

CHECKPOINT_DIR = Path(__file__).resolve().parent / "checkpoint"


def demo_model_dir() -> Path:
    """The shipped checkpoint directory (config.json, params/, byte_tokenizer.json)."""
    if not (CHECKPOINT_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the demo model is missing from {CHECKPOINT_DIR}: reinstall jaxserve, or train it "
            f"with `python -m jaxserve.demo.train`"
        )
    return CHECKPOINT_DIR


DRAFT_DIR = Path(__file__).resolve().parent / "draft"


def demo_draft_dir() -> Path:
    """The demo's shipped draft model for speculative decoding: a much smaller byte-level
    model trained by `jaxserve.demo.train --config draft` on the same text."""
    if not (DRAFT_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the demo's draft model is missing from {DRAFT_DIR}: reinstall jaxserve, or train "
            "it with `python -m jaxserve.demo.train --config draft`")
    return DRAFT_DIR
