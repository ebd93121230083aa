"""Data parallelism across processes (jaxserve/parallel/runners.py): `-dp 2` over two `jaxserve
serve` processes (each its own replica, tp=1) and over four (two replicas of tp=2, each over two
processes). The server on process 0 routes requests to both replicas and gives stories260K's
C-reference ids, structured output included; a replica's process killed under load fails that
replica's requests with a 503 while the other replica's complete, and the server serves on."""

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from served import metrics_of
from test_multi_host import FLAGS, STORIES, free_port

ROOT = Path(__file__).resolve().parents[1]
CASES = json.loads((STORIES / "reference_outputs.json").read_text())["cases"]


@contextlib.contextmanager
def replicas(tmp_path: Path, num_processes: int, tp: int):
    """`num_processes` processes of one device each serving dp=2 x tp; yields (URL, the
    processes by id, their logs); all are killed on the way out."""
    coordinator, port = free_port(), free_port()
    env = os.environ | {"XLA_FLAGS": "--xla_force_host_platform_device_count=1",
                        "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    # one decode bucket (fewer shapes to compile in four processes on a small machine)
    flags = [f for f in FLAGS if f not in ("-tp", "4")] + ["--row-buckets", "8"]
    common = [sys.executable, "-m", "jaxserve.cli", "serve", str(STORIES), *flags, "-tp",
              str(tp), "-dp", "2", "--coordinator-address", f"127.0.0.1:{coordinator}",
              "--num-processes", str(num_processes)]
    logs = [tmp_path / f"process{p}.log" for p in range(num_processes)]
    procs: dict[int, subprocess.Popen] = {}
    try:
        for p in reversed(range(num_processes)):
            extra = ("--port", str(port)) if p == 0 else ()
            with logs[p].open("w") as out:
                procs[p] = subprocess.Popen([*common, "--process-id", str(p), *extra],
                                            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                            env=env)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 400
        while True:
            assert procs[0].poll() is None and time.monotonic() < deadline, "\n".join(
                log.read_text()[-2000:] for log in logs)
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health").status_code == 200:
                    break
            time.sleep(0.3)
        yield url, procs, logs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def complete(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120, json={"model": str(STORIES)} | body)


def serves_the_reference(url: str) -> None:
    """The reference cases at once (both replicas take some), each the C reference's text,
    and structured requests (the leader's masks, sent to whichever replica runs them)."""
    with concurrent.futures.ThreadPoolExecutor(len(CASES) + 4) as pool:
        answers = list(pool.map(lambda case: complete(url, {
            "prompt": case["prompt_ids"], "temperature": 0, "ignore_eos": True,
            "max_tokens": len(case["generated_ids"])}), CASES))
        structured = list(pool.map(lambda _: complete(url, {
            "prompt": "Once upon a time there was a girl named", "max_tokens": 8,
            "temperature": 0, "structured_outputs": {"choice": ["Tom", "Sue"]}}), range(4)))
    for case, r in zip(CASES, answers, strict=True):
        assert r.status_code == 200, r.text
        assert case["prompt"] + r.json()["choices"][0]["text"] == case["text"]
    for r in structured:
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("Tom", "Sue"), r.text


def a_lost_replica_fails_only_its_requests(url: str, procs, logs, victim: int) -> None:
    """Long requests on both replicas; `victim` (a process of replica 1) killed: replica 1's
    requests get a 503 naming its replica, replica 0's their full output; the server serves on."""
    with concurrent.futures.ThreadPoolExecutor(6) as pool, httpx.Client(base_url=url) as http:
        futures = [pool.submit(complete, url, {"prompt": "Once", "max_tokens": 400,
                                               "ignore_eos": True}) for _ in range(6)]
        deadline = time.monotonic() + 120
        while metrics_of(http)["jaxserve:num_requests_running"] < 6:
            assert time.monotonic() < deadline and not any(f.done() for f in futures)
            time.sleep(0.02)
        procs[victim].send_signal(signal.SIGKILL)
        answers = [f.result(timeout=120) for f in futures]
    codes = [r.status_code for r in answers]  # (routing by load: both replicas ran some)
    assert set(codes) == {200, 503}, [r.text for r in answers]
    for r in answers:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 400
        else:
            # the victim named, or its replica's head, which a collective with it failed
            assert any(f"replica 1 is lost: process {p}" in r.text
                       for p in (victim, victim - 1)), r.text
    assert procs[0].poll() is None
    for case in CASES[:2]:  # replica 0 serves on, every new request goes to it
        r = complete(url, {"prompt": case["prompt_ids"], "temperature": 0,
                           "ignore_eos": True, "max_tokens": len(case["generated_ids"])})
        assert r.status_code == 200 and case["prompt"] + r.json()["choices"][0]["text"] \
            == case["text"], r.text
    assert "replica 1 is lost" in logs[0].read_text()


def test_dp2_over_two_processes_serves_the_reference_and_outlives_a_lost_replica(tmp_path):
    with replicas(tmp_path, 2, tp=1) as (url, procs, logs):
        serves_the_reference(url)
        a_lost_replica_fails_only_its_requests(url, procs, logs, victim=1)
        procs[0].send_signal(signal.SIGTERM)  # a clean stop without the lost replica
        assert procs[0].wait(timeout=60) == 0, logs[0].read_text()[-3000:]


def test_dp2_tp2_over_four_processes_serves_the_reference_and_outlives_a_lost_replica(
        tmp_path):
    with replicas(tmp_path, 4, tp=2) as (url, procs, logs):
        serves_the_reference(url)
        # replica 1's second process: its head stops too (a collective it cannot finish)
        a_lost_replica_fails_only_its_requests(url, procs, logs, victim=3)
        assert procs[2].wait(timeout=60) != 0
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(timeout=60) == 0, logs[0].read_text()[-3000:]
        assert procs[1].wait(timeout=60) == 0, logs[1].read_text()[-3000:]
