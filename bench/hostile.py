"""A hostile client against `jaxserve serve`: a mixed load, and a mass abort of queued sequences.

    python bench/hostile.py                       # the demo model
    python bench/hostile.py --model models/stories260K

1. Load: 400 clients at once, 100 of them hostile (oversized bodies, malformed JSON, streams
   dropped after their first event, headers that never end), against a server with a small
   queue (--max-waiting-requests 32). Prints the answers by kind and status, the 5xx count, and
   how long the engine's queues, its KV pool and the server's open connections took to return
   to idle.
2. Mass abort: 25 clients queue 4,000 sequences each (100,000), then all disconnect; prints how
   long the next 4-token completion took from the moment they went, and how long until the
   queue was empty (three times on one server, and the median).
"""

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time

import httpx

from jaxserve.benchmarks import hostile


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


@contextlib.contextmanager
def _server(model: str | None, *flags: str):
    port = _free_port()
    command = [sys.executable, "-m", "jaxserve.cli", "serve", *([model] if model else []),
               "--port", str(port), *flags]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {' '.join(command)}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health").status_code == 200:
                    break
            time.sleep(0.5)
        yield proc, url
    finally:
        proc.terminate()
        proc.wait(60)


def _gauges(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=120).text.splitlines():
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            if line.startswith(f"jaxserve:{name}{{"):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


def _open_connections(pid: int, port: int) -> int:
    """Established TCP connections on the server's port, from the kernel's table."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                    count += 1
    return count


def _until_idle(url: str, pid: int, port: int, timeout: float = 120.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        g = _gauges(url)
        if (not g["num_requests_running"] and not g["num_requests_waiting"]
                and not g["kv_cache_usage_perc"] and not _open_connections(pid, port)):
            return time.monotonic() - start
        time.sleep(0.05)
    raise RuntimeError(f"not idle after {timeout} s: {_gauges(url)}")


def load(model: str | None, clients: int, num_hostile: int) -> dict:
    with _server(model, "--max-waiting-requests", "32", "--header-timeout-s", "5") as (proc, url):
        port = int(url.rsplit(":", 1)[1])
        result = asyncio.run(hostile.run(url, clients, num_hostile, stall_s=30))
        result["idle_after_s"] = _until_idle(url, proc.pid, port)
        result["num_5xx"] = sum(n for kind in result["statuses"].values()
                                for status, n in kind.items() if status >= 500)
    return result


async def _mass_abort(url: str, clients: int, per_client: int) -> dict:
    body = {"prompt": ["x"] * per_client, "max_tokens": 2}
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=clients + 4)) as client:
        tasks = [asyncio.ensure_future(client.post("/v1/completions", json=body))
                 for _ in range(clients)]
        start, queued, still = time.monotonic(), 0.0, 0
        while queued < 0.9 * clients * per_client or still < 3:  # all in: no more growth
            if time.monotonic() - start > 600:
                raise RuntimeError(f"the flood did not queue: {_gauges(url)}")
            await asyncio.sleep(0.2)
            now = _gauges(url)["num_requests_waiting"]
            still, queued = (still + 1 if now <= queued else 0), max(queued, now)
        queue_s = time.monotonic() - start
        for task in tasks:
            task.cancel()  # each client disconnects: its requests are aborted
        gone = time.monotonic()
        await asyncio.gather(*tasks, return_exceptions=True)
        r = await client.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 4})
        served_s = time.monotonic() - gone
        assert r.status_code == 200, r.text
        while _gauges(url)["num_requests_waiting"]:
            await asyncio.sleep(0.01)
        empty_s = time.monotonic() - gone
    return {"queued_sequences": int(queued), "seconds_to_queue": round(queue_s, 2),
            "next_request_served_after_s": round(served_s, 3),
            "queue_empty_after_s": round(empty_s, 3)}


def mass_abort(model: str | None, clients: int, per_client: int, repeats: int) -> dict:
    flags = ("--max-waiting-requests", str(2 * clients * per_client),
             "--max-seqs-per-request", str(per_client))
    with _server(model, *flags) as (_, url):
        runs = [asyncio.run(_mass_abort(url, clients, per_client)) for _ in range(repeats)]
    served = sorted(run["next_request_served_after_s"] for run in runs)
    return {"runs": runs, "median_next_request_served_after_s": served[len(served) // 2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model directory (default: the demo model)")
    parser.add_argument("--clients", type=int, default=400)
    parser.add_argument("--hostile", type=int, default=100)
    parser.add_argument("--abort-clients", type=int, default=25)
    parser.add_argument("--abort-per-client", type=int, default=4000)
    parser.add_argument("--abort-repeats", type=int, default=3)
    parser.add_argument("--only", choices=("load", "mass_abort"), help="run one part")
    args = parser.parse_args()
    os.environ.setdefault("JAXSERVE_LOG_LEVEL", "warning")
    out = {}
    if args.only in (None, "load"):
        out["load"] = load(args.model, args.clients, args.hostile)
    if args.only in (None, "mass_abort"):
        out["mass_abort"] = mass_abort(args.model, args.abort_clients, args.abort_per_client,
                                       args.abort_repeats)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
