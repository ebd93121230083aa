"""The `jaxserve` CLI as a user runs it (subprocesses on stories260K): `serve` starts quietly,
answers and exits 0 on SIGTERM after finishing what is in flight, `generate` streams the greedy
completion; and the configs/ files hold only engine and server keys."""

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import SERVER_ENGINE, SERVER_ENGINE_FLAGS

from jaxserve import LLM, SamplingParams
from jaxserve.config.engine import EngineConfig
from jaxserve.server import ServerConfig

MODEL = "stories"
PROMPT = "Once upon a time"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def reference(stories_dir):
    return LLM(stories_dir, **SERVER_ENGINE)


def _greedy(reference, prompt, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return reference.generate(prompt, params)[0].outputs[0]


def test_config_files_hold_engine_and_server_keys():
    server_keys = set(ServerConfig.__dataclass_fields__)
    for path in (ROOT / "configs").glob("*.yaml"):
        data = yaml.safe_load(path.read_text())
        server = ServerConfig(**{k: v for k, v in data.items() if k in server_keys})
        engine = EngineConfig.from_overrides(**{k: v for k, v in data.items()
                                                if k not in server_keys})
        if path.name == "default.yaml":  # it documents the defaults, every key of them
            assert (server, engine) == (ServerConfig(), EngineConfig())
            assert set(data) == server_keys | set(EngineConfig.__dataclass_fields__)


def test_serve_binds_its_port_before_loading_the_model(capsys):
    """A port in use fails at once (the model here does not even exist: loading it would fail
    differently), not after minutes of compiling."""
    from jaxserve.cli import main

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        assert main(["serve", "/nonexistent/model", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert "in use" in err and "nonexistent" not in err


def test_bench_takes_the_config_files_seed_unless_seed_is_given(tmp_path, monkeypatch):
    from jaxserve.benchmarks import throughput
    from jaxserve.cli import main

    seen = []
    monkeypatch.setattr(throughput, "run", lambda args, options: seen.append(options["seed"]))
    config = tmp_path / "c.yaml"
    config.write_text("seed: 7\n")
    assert main(["bench", "throughput", "--config", str(config)]) == 0
    assert main(["bench", "throughput", "--config", str(config), "--seed", "3"]) == 0
    assert main(["bench", "throughput"]) == 0
    assert seen == [7, 3, 0]


@pytest.mark.parametrize(("key", "value"), [
    ("port", "8000"), ("port", 8000.5), ("shutdown_grace_s", None),
    ("max_waiting_requests", "64"), ("api_key", 12345), ("request_timeout_s", float("nan")),
    ("host", None), ("max_body_bytes", 1.5),
])
def test_server_config_refuses_wrong_types_naming_the_key(key, value):
    """A YAML file may hold any value: a ValueError naming the key before the model loads,
    not a TypeError (or a failure after the model compiled)."""
    with pytest.raises(ValueError, match=rf"^{key} must be"):
        ServerConfig(**{key: value})


@pytest.mark.parametrize(("key", "value"), [
    ("window_ms", float("nan")), ("window_ms", float("inf")), ("window_ms", "5"),
    ("slo_ms", "x"), ("kv_cache_memory_fraction", "0.9"), ("max_top_logprobs", None),
    ("max_num_seqs", True), ("adaptive_window", "yes"),
])
def test_engine_config_rejects_values_that_would_stall_or_break_it(key, value):
    """A NaN or infinite window never opens; a string where a number belongs fails deep inside.
    Both are a ValueError naming the key, as a config file or a flag would give them."""
    with pytest.raises(ValueError, match=rf"^{key} must be"):
        EngineConfig.from_overrides(**{key: value})


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


@contextlib.contextmanager
def _cli_server(stories_dir, *flags):
    """`jaxserve serve` in a subprocess, up and healthy: yields (process, base URL); killed if
    still running at the end."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.cli", "serve", str(stories_dir), "--port", str(port),
         *flags, *SERVER_ENGINE_FLAGS],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "JAXSERVE_LOG_LEVEL"}  # info
        | {"PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health").status_code == 200:
                    break
            time.sleep(0.2)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()


def _stream_through_sigterm(proc, url: str, body: dict) -> list[str]:
    """Stream `body`, SIGTERM the server after the first event; the data lines after it."""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        proc.send_signal(signal.SIGTERM)
        return [line for line in lines if line.startswith("data: ")]


def test_cli_serve_starts_quietly_answers_then_exits_0_on_sigterm(stories_dir, tmp_path):
    """Served from an orbax checkpoint (orbax logs through absl at INFO): the start-up output
    has jaxserve's lines only, naming the model, the KV pool and the URL."""
    from jaxserve.cli import main

    checkpoint = tmp_path / "stories-orbax"
    assert main(["convert", str(stories_dir), str(checkpoint)]) == 0
    # a grace the stream needs a fraction of on any machine (it exits once the stream ends)
    with _cli_server(checkpoint, "--served-model-name", MODEL,
                     "--shutdown-grace-s", "120") as (proc, url):
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        body = {"prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        rest = _stream_through_sigterm(proc, url, body)  # finished within the grace period
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["usage"]["completion_tokens"] == 300
        assert proc.wait(timeout=30) == 0
    out = proc.stdout.read()
    assert f"serving {MODEL!r} at {url}/v1" in out and '"POST /v1/completions" 200' in out
    assert f"model: {checkpoint} (LlamaForCausalLM, 0.26M parameters, float32)" in out
    assert "KV pool: 255 pages of 8 tokens = 2040 tokens" in out
    assert "compiling: 100%" in out
    talking = set(re.findall(r"^\S+ \S+ (?:INFO|DEBUG) (\S+): ", out, re.MULTILINE))
    assert talking and all(name.split(".")[0] == "jaxserve" for name in talking), talking


@pytest.mark.parametrize(("level", "ours", "others"), [
    ("info", logging.INFO, logging.WARNING), ("Error", logging.ERROR, logging.WARNING),
    ("debug", logging.DEBUG, logging.INFO)])
def test_log_level_is_jaxserves_own_unless_debug(level, ours, others, monkeypatch, capsys):
    """`JAXSERVE_LOG_LEVEL` (or `--log-level`) sets jaxserve's loggers; absl (orbax's), jax and
    uvicorn stay at WARNING, except at debug. A level that is no level is an error naming it."""
    from absl import logging as absl_logging

    from jaxserve.cli import main

    root, own = logging.getLogger(), logging.getLogger("jaxserve")
    saved = root.level, own.level
    monkeypatch.setenv("JAXSERVE_LOG_LEVEL", level)
    try:
        assert main(["generate", "/nonexistent", "--prompt", "hi"]) == 2  # after the logging
        assert logging.getLogger("jaxserve.server").getEffectiveLevel() == ours
        for logger in (absl_logging.get_absl_logger(), logging.getLogger("jax"),
                       logging.getLogger("uvicorn.error")):
            assert logger.getEffectiveLevel() == others, logger.name
        monkeypatch.setenv("JAXSERVE_LOG_LEVEL", "loud")
        assert main(["generate", "/nonexistent", "--prompt", "hi", "--log-level", level]) == 2
        assert own.level == ours  # the flag wins over the variable
        assert main(["generate", "/nonexistent", "--prompt", "hi"]) == 2
        assert "JAXSERVE_LOG_LEVEL must be one of debug, info, warning, error, got 'loud'" in \
            capsys.readouterr().err
    finally:
        root.setLevel(saved[0])
        own.setLevel(saved[1])


def test_cli_serve_ends_open_streams_with_an_error_event_past_the_grace(stories_dir):
    """A stream still running when the grace period ends gets the engine's 503 as an error
    event and [DONE] (not a cut connection), and the server exits 0."""
    with _cli_server(stories_dir, "--shutdown-grace-s", "0") as (proc, url):
        body = {"prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "stream": True}
        rest = _stream_through_sigterm(proc, url, body)
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert error["code"] == 503 and "shut" in error["message"]
        assert proc.wait(timeout=30) == 0


def test_cli_generate_streams_the_completion(stories_dir, reference):
    want = _greedy(reference, PROMPT, 12).text
    out = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "generate", str(stories_dir), "--prompt", PROMPT,
         "--max-tokens", "12", *SERVER_ENGINE_FLAGS], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == PROMPT + want + "\n"


def test_cli_generate_and_convert_refuse_bad_input_before_loading(stories_dir, tmp_path, capsys):
    from jaxserve.cli import main

    assert main(["generate", "Once upon a time"]) == 2  # the text landed in the model slot
    assert "no prompt: pass --prompt TEXT ('Once upon a time', the first argument, is the " \
           "model)" in capsys.readouterr().err
    assert main(["generate", "/nonexistent", "--prompt", "hi", "--max-tokens", "-1"]) == 2
    assert "max_tokens" in capsys.readouterr().err  # before the missing model is noticed
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    assert main(["convert", str(stories_dir), str(in_the_way)]) == 2  # not a traceback
    assert "jaxserve: error:" in capsys.readouterr().err
    assert main(["convert", str(stories_dir), str(stories_dir) + "/."]) == 2  # into itself
    assert "is HF_DIR itself" in capsys.readouterr().err
    # a server bench serve cannot reach: said in one line, not a traceback
    closed = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    closed.close()
    assert main(["bench", "serve", "--base-url", url, "--num-prompts", "1"]) == 2
    assert f"cannot reach {url}" in capsys.readouterr().err
