"""Several processes serving one model (jaxserve/parallel/distributed.py): two `jaxserve serve` processes
on 127.0.0.1, each with 2 host devices, tp=4 across them, CPU collectives through gloo. Process
0 serves stories260K's C-reference prompts with the reference ids, and a structured request; a
follower killed makes it fail its requests and exit non-zero naming the lost process; a clean
stop ends both; start-up mismatches are clear errors. The encoding of the leader's calls is
checked on its own too."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from served import metrics_of

from jaxserve.cli import main
from jaxserve.core.scheduler_output import ScheduledChunk, SchedulerOutput
from jaxserve.parallel.distributed import Processes
from jaxserve.parallel.encoding import Decoder, Encoder
from jaxserve.request import Request, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT / "models" / "stories260K"
FLAGS = ["-tp", "4", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
         "--prefill-chunk-sizes", "32", "--page-size", "8", "--num-pages", "256",
         "--no-enable-prompt-logprobs"]


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


@contextlib.contextmanager
def processes(tmp_path: Path, follower_flags: tuple[str, ...] = (), wait: bool = True):
    """Process 0 (the server) and process 1 of one model; yields (URL, leader, follower,
    the logs); both are killed on the way out."""
    coordinator, port = free_port(), free_port()
    env = os.environ | {"XLA_FLAGS": "--xla_force_host_platform_device_count=2",
                        "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    common = [sys.executable, "-m", "jaxserve.cli", "serve", str(STORIES), *FLAGS,
              "--coordinator-address", f"127.0.0.1:{coordinator}", "--num-processes", "2"]
    logs = [tmp_path / "process0.log", tmp_path / "process1.log"]
    procs = []
    try:
        for pid, extra in ((1, follower_flags), (0, ("--port", str(port)))):
            with logs[pid].open("w") as out:
                procs.append(subprocess.Popen([*common, "--process-id", str(pid), *extra],
                                              stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                              env=env))
        follower, leader = procs
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while wait:
            assert leader.poll() is None and time.monotonic() < deadline, \
                logs[0].read_text()[-3000:] + logs[1].read_text()[-3000:]
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health").status_code == 200:
                    break
            time.sleep(0.3)
        yield url, leader, follower, logs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def exit_within(proc: subprocess.Popen, seconds: float) -> int:
    """The process's exit code; a process still running after `seconds` (hung) fails the
    test with TimeoutExpired."""
    return proc.wait(timeout=seconds)


def test_two_processes_serve_the_reference_then_a_lost_follower_stops_the_server(tmp_path):
    cases = json.loads((STORIES / "reference_outputs.json").read_text())["cases"]
    with processes(tmp_path) as (url, leader, follower, logs):
        for case in cases:  # the server's text of the reference ids, after the prompt's
            r = httpx.post(url + "/v1/completions", timeout=60, json={
                "model": str(STORIES), "prompt": case["prompt_ids"], "temperature": 0,
                "max_tokens": len(case["generated_ids"]), "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert case["prompt"] + r.json()["choices"][0]["text"] == case["text"]
        # a structured request: its token masks are process 0's, sent with its steps
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": str(STORIES), "prompt": "Once upon a time there was a girl named",
            "max_tokens": 8, "structured_outputs": {"choice": ["Lily", "Tom", "Sue"]},
            "bad_words": ["Lily"]})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("Tom", "Sue"), r.text
        # a long request runs when process 1 is killed: it fails, and process 0 exits
        answers = []

        def long_request():
            answers.append(httpx.post(url + "/v1/completions", timeout=60, json={
                "model": str(STORIES), "prompt": "Once", "max_tokens": 400,
                "ignore_eos": True}))

        thread = threading.Thread(target=long_request)
        thread.start()
        with httpx.Client(base_url=url) as http:  # process 1 goes once the request runs
            deadline = time.monotonic() + 60
            while metrics_of(http)["jaxserve:num_requests_running"] < 1:
                assert time.monotonic() < deadline and thread.is_alive(), answers
                time.sleep(0.01)
        follower.send_signal(signal.SIGKILL)
        code = exit_within(leader, 30)  # the bound: nothing hangs
        thread.join(30)
        output = logs[0].read_text()
        assert code != 0
        assert "process 1 is lost" in output, output[-3000:]
        assert answers and answers[0].status_code == 503, answers


def test_a_clean_stop_of_the_server_stops_every_process(tmp_path):
    with processes(tmp_path) as (url, leader, follower, logs):
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": str(STORIES), "prompt": "Once", "max_tokens": 8})
        assert r.status_code == 200
        leader.send_signal(signal.SIGTERM)
        assert exit_within(leader, 60) == 0, logs[0].read_text()[-3000:]
        assert exit_within(follower, 60) == 0, logs[1].read_text()[-3000:]
        assert "process 0 stopped" in logs[1].read_text()


@pytest.mark.parametrize(("flags", "difference"), [
    (("--num-pages", "128"), "num_pages 128, process 0 256"),
    (("--num-processes", "3"), "num_processes 3, process 0 2")])
def test_processes_started_differently_stop_with_a_clear_error(tmp_path, flags, difference):
    with processes(tmp_path, flags, wait=False) as (_, leader, follower, logs):
        assert exit_within(leader, 60) != 0
        said = logs[0].read_text()
        assert f"process 1 failed: process 1 serves {difference}: every process must be " \
            "started with the same model and options" in said, said[-3000:]
        assert exit_within(follower, 60) != 0


def test_bad_process_flags_are_clear_errors(capsys):
    for flags, message in (
            (["--num-processes", "2"], "needs --coordinator-address"),
            (["--num-processes", "2", "--process-id", "2", "--coordinator-address",
              "127.0.0.1:1"], r"process_id must be in [0, 2)"),
            (["--num-processes", "2", "--process-id", "1", "--coordinator-address",
              "nowhere"], "coordinator_address must be HOST:PORT")):
        assert main(["serve", str(STORIES), *flags]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="num_processes must be a positive integer"):
        Processes("127.0.0.1:1", 0, 0)


def test_the_leaders_calls_decode_to_what_the_runner_reads():
    """A request's state is sent whole the first step it runs, then only what it appended;
    a preemption, or a step that leaves it out, sends it whole again."""
    encoder, decoder = Encoder(), Decoder()
    a = Request("a", [5, 6, 7], SamplingParams(max_tokens=9, temperature=0.5), 0.0, 11, 20,
                frozenset())
    a.pages = [3]

    def step(*chunks):
        message = encoder.encode(SchedulerOutput(chunks=list(chunks), decode_steps=1))
        return message, decoder.decode(message)

    message, out = step(ScheduledChunk(a, 0, 3, 1))
    stand_in = out.chunks[0].request
    assert len(message["states"][0]) == 7  # whole
    assert (stand_in.prompt_ids, stand_in.pages, stand_in.seed) == ([5, 6, 7], [3], 11)
    a.output_ids += [8]
    a.pages += [4]
    message, out = step(ScheduledChunk(a, 3, 1, 1))
    assert message["states"] == [("a", [8], [4])]  # appended only
    assert out.chunks[0].request is stand_in and stand_in.token_ids(2, 4) == [7, 8]
    assert stand_in.pages == [3, 4]
    step()  # a step without it
    a.output_ids += [9]
    message, out = step(ScheduledChunk(a, 4, 1, 1))
    assert len(message["states"][0]) == 7 and out.chunks[0].request.output_ids == [8, 9]
    a.metrics.num_preemptions += 1
    a.pages = [7]
    message, out = step(ScheduledChunk(a, 0, 5, 1))
    assert len(message["states"][0]) == 7 and out.chunks[0].request.pages == [7]
    assert out.chunks[0].request.metrics.num_preemptions == 1
