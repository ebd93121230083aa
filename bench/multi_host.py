"""Several processes against one: what serving across processes costs a step, on this machine.

    python bench/multi_host.py [--model models/stories260K] [--tokens 200] [--rows 1 32]

The same model at tensor_parallel_size 4 served by `jaxserve serve` two ways, one after the
other: one process holding 4 host devices, and two processes of 2 host devices each (process 0
the server and scheduler, process 1 replaying its calls; their collectives through gloo over
loopback). For each, `--rows` greedy requests at once of `--tokens` tokens each (EOS
ignored), three times: milliseconds per output token of the slowest request (a step's time at
that batch), the best of the three. The difference between the two setups is what the
processes add: the control plane (the leader's calls reaching the follower) and the
collectives crossing processes; the compiled step's own time in lockstep is not separated
here yet.
"""

import argparse
import concurrent.futures
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["-tp", "4", "--max-num-seqs", "32", "--max-num-batched-tokens", "256",
         "--prefill-chunk-sizes", "32", "--page-size", "16", "--num-pages", "1024",
         "--no-enable-prompt-logprobs", "--row-buckets", "2", "32"]


def _port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(model: str, num_processes: int, log_dir: Path):
    """`jaxserve serve` as one process of 4 devices or `num_processes` of 4 / n each; yields
    its URL once /health answers."""
    port, coordinator = _port(), _port()
    devices = 4 // num_processes
    env = os.environ | {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
                        "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "jaxserve.cli", "serve", model, *FLAGS]
    procs = []
    try:
        for pid in reversed(range(num_processes)):
            extra = ["--port", str(port)] if pid == 0 else []
            if num_processes > 1:
                extra += ["--coordinator-address", f"127.0.0.1:{coordinator}",
                          "--num-processes", str(num_processes), "--process-id", str(pid)]
            with (log_dir / f"{num_processes}-{pid}.log").open("w") as out:
                procs.append(subprocess.Popen([*command, *extra], stdout=out,
                                              stderr=subprocess.STDOUT, cwd=ROOT, env=env))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            if procs[-1].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: see {log_dir}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health").status_code == 200:
                    break
            time.sleep(0.3)
        yield url
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(30)
            if p.poll() is None:
                p.kill()


def per_token_ms(url: str, rows: int, tokens: int) -> float:
    """`rows` greedy requests at once; the slowest's milliseconds per output token."""
    body = {"model": "x", "prompt": "Once upon a time", "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=600, limits=httpx.Limits(max_connections=rows)) as client:
        model = client.get(url + "/v1/models").json()["data"][0]["id"]
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(rows) as pool:
            done = list(pool.map(lambda _: client.post(
                url + "/v1/completions", json=body | {"model": model}), range(rows)))
        elapsed = time.perf_counter() - start
    for r in done:
        r.raise_for_status()
    return 1000 * elapsed / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "stories260K"))
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="the servers' logs (default: a new temporary directory)")
    args = parser.parse_args()
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="jaxserve-multi-host-"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[int, int], float] = {}
    for processes in (1, 2):
        with serving(args.model, processes, args.log_dir) as url:
            per_token_ms(url, 1, 8)  # the first request's own costs (its prompt's cache)
            for rows in args.rows:
                results[processes, rows] = min(per_token_ms(url, rows, args.tokens)
                                               for _ in range(args.rounds))
    print(f"{Path(args.model).name}, tp=4, {args.tokens} greedy tokens a request, best of "
          f"{args.rounds}: ms per output token")
    print(f"{'rows':>6}{'one process':>14}{'two processes':>16}{'ratio':>8}")
    for rows in args.rows:
        one, two = results[1, rows], results[2, rows]
        print(f"{rows:>6}{one:>14.2f}{two:>16.2f}{two / one:>7.2f}x")


if __name__ == "__main__":
    main()
