"""The demo model's corpus: the Python standard library's own source files on this machine.

Every machine with Python has them, and they are under the PSF license. Files are read in sorted
order of their path relative to the stdlib root; a file is held out for validation when a hash
of that path falls under `VALIDATION_FRACTION`, so the split does not depend on which other
files exist. Each file is one document, BOS + its bytes + EOS, and a split is the documents of
its files laid end to end:

    stream  [BOS f0 bytes ... EOS BOS f1 bytes ... EOS BOS ...]
    window  stream[o : o + length + 1]   inputs window[:-1], targets window[1:]
    prompt  [BOS] + stream[s : s + length]   s: the start of an unindented line

Prompt windows exist because every request the engine sees starts with BOS at position 0, most
often followed by code at column 0 (`def fibonacci(n):`), while a random window almost never
does: trained on random windows alone, the model has seen BOS open a file's docstring a few
hundred times and does not know that the line after BOS starts at column 0.
"""

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxserve.text.tokenizer import ByteTokenizer

VALIDATION_FRACTION = 0.05
# Third-party packages are not the standard library; the test suites are mostly fixtures.
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                          "__pycache__"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[str]:
    """Relative posix paths of the .py files under `root`, sorted, skipping SKIPPED_DIRS."""
    files = (p.relative_to(root) for p in root.rglob("*.py") if p.is_file())
    return sorted(p.as_posix() for p in files if not SKIPPED_DIRS.intersection(p.parts[:-1]))


def is_validation(relative_path: str) -> bool:
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:8], "big") < VALIDATION_FRACTION * 2**64


@dataclass(frozen=True)
class Corpus:
    """The train and validation token streams (uint16 ids) and where they came from."""

    root: Path
    train: np.ndarray  # [train tokens] uint16
    val: np.ndarray  # [val tokens] uint16
    num_train_files: int
    num_val_files: int

    def describe(self) -> dict:
        return {"root": str(self.root), "train_files": self.num_train_files,
                "val_files": self.num_val_files, "train_tokens": int(self.train.size),
                "val_tokens": int(self.val.size)}


def _stream(root: Path, files: list[str]) -> np.ndarray:
    bos, eos = ByteTokenizer.BOS_ID, ByteTokenizer.EOS_ID
    parts = []
    for rel in files:
        data = np.frombuffer((root / rel).read_bytes(), np.uint8).astype(np.uint16)
        parts += [np.array([bos], np.uint16), data, np.array([eos], np.uint16)]
    return np.concatenate(parts) if parts else np.zeros((0,), np.uint16)


def load_corpus(root: Path | None = None, max_files: int | None = None) -> Corpus:
    """The corpus under `root` (default: this Python's stdlib); `max_files` keeps the first ones
    of each split in path order (for quick runs)."""
    root = stdlib_root() if root is None else Path(root)
    files = source_files(root)
    val = [f for f in files if is_validation(f)]
    train = [f for f in files if not is_validation(f)]
    if max_files is not None:
        train, val = train[:max_files], val[:max(1, max_files // 20)]
    if not train or not val:
        raise FileNotFoundError(f"no Python source files to train and validate on under {root}")
    return Corpus(root, _stream(root, train), _stream(root, val), len(train), len(val))


def line_starts(stream: np.ndarray) -> np.ndarray:  # [num lines] int64
    """Offsets of the lines that start with code at column 0 (after a newline or BOS)."""
    after = np.isin(stream[:-1], (ord("\n"), ByteTokenizer.BOS_ID))
    code = ~np.isin(stream[1:], (ord(" "), ord("\t"), ord("\n"), ByteTokenizer.EOS_ID))
    return np.flatnonzero(after & code) + 1


def training_windows(stream: np.ndarray, starts: np.ndarray, rng: np.random.Generator,
                     batch: int, num_prompts: int,
                     length: int) -> np.ndarray:  # [batch, length + 1] int32
    """`batch - num_prompts` windows at uniformly random offsets, then `num_prompts` prompt
    windows: BOS and the stream from a random one of `starts` (from `line_starts`)."""
    offsets = rng.integers(0, stream.size - length - 1, size=batch - num_prompts)
    picks = rng.choice(starts[starts < stream.size - length], size=num_prompts)
    bos = np.array([ByteTokenizer.BOS_ID], stream.dtype)
    rows = [stream[o:o + length + 1] for o in offsets]
    rows += [np.concatenate([bos, stream[s:s + length]]) for s in picks]
    return np.stack(rows).astype(np.int32)


def evenly_spaced_windows(stream: np.ndarray, count: int,
                          length: int) -> np.ndarray:  # [count, length + 1] int32
    """A fixed sample: `count` windows spread evenly over the stream (validation)."""
    starts = np.linspace(0, stream.size - length - 1, num=count).astype(np.int64)
    return np.stack([stream[s:s + length + 1] for s in starts]).astype(np.int32)
