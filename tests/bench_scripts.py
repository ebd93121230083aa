"""The scripts under bench/, loaded as modules by the tests that run them (test_benchmarks.py,
test_bench_scripts.py, test_bench_yardsticks.py)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
