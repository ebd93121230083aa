"""Shared fixtures: the test models shipped in the repository, and the test server
(module-scoped: a module that asks for it gets its own)."""

import gc
import os
from pathlib import Path
from types import SimpleNamespace

# The suite runs on this machine's CPU whatever else is installed: the accelerator compilers of
# the aot extras (libtpu, the CUDA plugin: tests/test_compile_targets.py) are then neither
# initialised nor heard (each logs at start-up otherwise), here and in the subprocesses
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

import httpx
import openai
import pytest
from served import AUTH, BODY_LIMIT, KEEPALIVE, KEY, MODEL, uvicorn_url

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    """The stories260K model directory the repository ships (models/stories260K); never skipped."""
    path = ROOT / "models" / "stories260K"
    if not (path / "tokenizer.json").is_file():
        pytest.fail(f"the repository's stories260K is missing: {path}")
    return path


HF_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"
HF_MODELS = ("llama", "llama3", "qwen2", "qwen3", "mistral", "phi3", "phi3_longrope", "gemma2",
             "gemma3", "mixtral", "qwen2_moe", "qwen3_moe")

# the server tests' engine: few buckets, so start-up compiles little; the CLI tests pass the
# same flags, so their subprocesses find every step in the persistent compilation cache
# (prompt logprobs on: echo with logprobs reports them)
SERVER_ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=128, prefill_chunk_sizes=(32,),
                     page_size=8, num_pages=256)
SERVER_ENGINE_FLAGS = ["--max-num-seqs", "8", "--max-num-batched-tokens", "128",
                       "--prefill-chunk-sizes", "32", "--page-size", "8", "--num-pages", "256"]


@pytest.fixture(scope="module")
def reference(stories_dir):
    """`LLM` on the server's engine settings. Built before the server's engine: the runner
    counts compilations process-wide, and the server must show none after its own warm-up."""
    from jaxserve import LLM

    return LLM(stories_dir, **SERVER_ENGINE)


@pytest.fixture(scope="module")
def server(stories_dir, reference):
    from jaxserve.config.engine import EngineConfig
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.server import ServerConfig, build_app

    engine = AsyncEngine(LLMEngine(stories_dir, EngineConfig.from_overrides(**SERVER_ENGINE)))
    app = build_app(engine, ServerConfig(api_key=KEY, max_body_bytes=BODY_LIMIT), MODEL)
    with uvicorn_url(app) as url:
        yield SimpleNamespace(url=url, engine=engine)


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """`jaxserve serve` on the built-in demo model, one subprocess for the whole session: the
    server the port of vLLM's OpenAI-server tests (test_vllm_*.py) runs against."""
    from demo_server import demo_server

    with demo_server(tmp_path_factory.mktemp("demo") / "serve.log") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                         http_client=openai.DefaultHttpxClient(limits=KEEPALIVE))


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30, limits=KEEPALIVE) as c:
        yield c


@pytest.fixture(scope="session")
def other_paths():
    """The CPU kernels' library built for AVX2 without AVX-512, and for no vector extensions at
    all (what other machines run), registered under their own target names (the suffixes)."""
    from cpu_kernels import library as cpu_library

    paths = {"_avx2": ("-mno-avx512f",), "_plain": ("-mno-avx512f", "-mno-avx2", "-mno-fma")}
    for suffix, flags in paths.items():
        cpu_library.register(cpu_library.build(flags), suffix)
    return tuple(paths)


def _memory_maps() -> tuple[int, int] | None:
    """(memory maps this process holds, the most it may: vm.max_map_count), where Linux says."""
    try:
        with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except (OSError, ValueError):
        return None


@pytest.fixture(scope="module", autouse=True)
def release_compiled_steps(request):
    """A module's engines and their compiled steps go with it. XLA's CPU executables hold their
    code in memory maps of their own, a process may hold at most vm.max_map_count of them
    (65,530 on most Linux machines), and the whole suite's engines together come near that: a
    compile or cache load past it segfaults. Torn down after the module's other fixtures; a
    module that alone comes within a quarter of the limit fails here, by name, instead."""
    yield
    import jax

    maps = _memory_maps()
    gc.collect()
    jax.clear_caches()
    if maps is not None and maps[0] > 0.75 * maps[1]:
        pytest.fail(f"{request.module.__name__} left {maps[0]} memory maps of the process's "
                    f"{maps[1]} (vm.max_map_count): XLA segfaults past it; release its "
                    "engines and compiled functions sooner")


_NO_AMX: list[str] = []  # the needs_amx tests this machine could not run


def pytest_collection_modifyitems(config, items):
    """Tests marked `needs_amx` exercise AMX tiles, which only a CPU with AMX-BF16 has: elsewhere
    they are deselected, not skipped (a skip reads as a test missing its files or packages, and
    CI fails on any), and the run's summary names them."""
    amx = [item for item in items if item.get_closest_marker("needs_amx")]
    if not amx:
        return
    from cpu_kernels import library as cpu_library

    if cpu_library.amx_ready():
        return
    config.hook.pytest_deselected(items=amx)
    items[:] = [item for item in items if not item.get_closest_marker("needs_amx")]
    _NO_AMX.extend(item.nodeid for item in amx)


def pytest_terminal_summary(terminalreporter):
    if _NO_AMX:
        terminalreporter.write_line(f"{len(_NO_AMX)} tests of the AMX matmul not run: this CPU "
                                    "has no AMX-BF16 (or the OS grants no tiles)")
