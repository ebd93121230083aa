"""Several processes against one: what serving across processes costs a step, on this machine.

    python bench/multi_host.py [--model models/stories260K] [--tokens 200] [--rows 1 32]

The same model at tensor_parallel_size 4, two setups one after the other: one process holding
4 host devices, and two processes of 2 host devices each (their collectives through gloo over
loopback). Each setup is measured twice, with the same processes and shapes:

  (a) lockstep: the compiled decode step alone (the runner's own `fns.decode`, one step a
      dispatch, the row bucket of the batch: 1 request -> 2 rows, 32 -> 32), called
      `--tokens` times on a fixed batch by every process at once, with no scheduler, no
      server and no leader's calls: what the step and its collectives cost;
  (b) served: `jaxserve serve` (process 0 the server and scheduler, process 1 replaying its
      calls), `--rows` greedy requests at once of `--tokens` tokens each (EOS ignored):
      milliseconds per output token of the slowest request, i.e. per step.

Each is the best of `--rounds`. b - a is the control time of a step (the scheduler, the host
side of the runner, the server, and across processes the leader's calls reaching the
followers), also given per output token (divided by the rows).
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
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# the engine of both measurements (served: as its flags; lockstep: its runner's config)
ENGINE = {"tensor_parallel_size": 4, "max_num_seqs": 32, "max_num_batched_tokens": 256,
          "prefill_chunk_sizes": (32,), "page_size": 16, "num_pages": 1024,
          "enable_prompt_logprobs": False, "row_buckets": (2, 32)}
START = 6  # the lockstep rows' first position: about where the served prompt's tokens end


def flags(options: dict) -> list[str]:
    """`jaxserve serve`'s flags for engine options."""
    out = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, *map(str, value if isinstance(value, tuple) else (value,))]
    return out


def _port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


@contextlib.contextmanager
def launched(commands: list[list[str]], num_processes: int, logs: list[Path]):
    """Each command as a process of 4 / num_processes host devices, its output in its log;
    yields the processes, stopped on the way out."""
    env = os.environ | {"XLA_FLAGS": "--xla_force_host_platform_device_count="
                                     f"{ENGINE['tensor_parallel_size'] // num_processes}",
                        "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    procs = []
    try:
        for command, log in zip(commands, logs, strict=True):
            with log.open("w") as out:
                procs.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                              cwd=ROOT, env=env))
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(30)
            if p.poll() is None:
                p.kill()


def group_flags(num_processes: int, coordinator: int, pid: int) -> list[str]:
    if num_processes == 1:
        return []
    return ["--coordinator-address", f"127.0.0.1:{coordinator}", "--num-processes",
            str(num_processes), "--process-id", str(pid)]


# -- (a) the compiled step alone, in lockstep ---------------------------------------------------


def lockstep(model: str, num_processes: int, args, log_dir: Path) -> dict[int, float]:
    """(a): by rows, ms per decode step, every process calling the runner's compiled step."""
    coordinator = _port()
    pids = list(reversed(range(num_processes)))  # process 0 last, as serving starts them
    commands = [[sys.executable, __file__, "--model", model, "--tokens", str(args.tokens),
                 "--rounds", str(args.rounds), "--rows", *map(str, args.rows),
                 "--lockstep-process", *group_flags(num_processes, coordinator, pid)]
                for pid in pids]
    logs = [log_dir / f"lockstep-{num_processes}-{pid}.log" for pid in pids]
    with launched(commands, num_processes, logs) as procs:
        for p in procs:
            if p.wait(timeout=1200) != 0:
                raise RuntimeError(f"a lockstep process failed: see {log_dir}")
    return {int(rows): float(ms) for _, rows, ms in (
        line.split() for line in logs[-1].read_text().splitlines()
        if line.startswith("LOCKSTEP "))}


def lockstep_process(args) -> None:
    """One process of (a): the runner built as a follower builds it
    (jaxserve/engine/follower.py), over every process's devices, then for each batch its
    decode step called `--tokens` times, the best of `--rounds`."""
    import jax

    if args.num_processes > 1:  # as jaxserve/parallel/distributed.py's initialize
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator_address, args.num_processes,
                                   args.process_id)
    from jaxserve.config.engine import EngineConfig
    from jaxserve.config.model import ModelConfig
    from jaxserve.runner.model_runner import ModelRunner

    config = EngineConfig.from_overrides(**ENGINE)
    path = Path(args.model)
    runner = ModelRunner(path, config.served_model(ModelConfig.from_hf_dir(path)), config,
                         None, jax.devices()[:config.tensor_parallel_size])
    for rows in args.rows:
        calls = decode_calls(runner, rows, args.tokens)
        run_steps(runner, calls[:8])  # its compile, and a warm-up
        seconds = min(run_steps(runner, calls) for _ in range(args.rounds))
        if jax.process_index() == 0:
            print(f"LOCKSTEP {rows} {1000 * seconds / len(calls):.4f}", flush=True)
    if args.num_processes > 1:
        jax.distributed.shutdown()


def decode_calls(runner, rows: int, steps: int) -> list[np.ndarray]:
    """The packed rows (model/decode_rows.py) of `steps` decode steps of `rows` greedy
    requests in their row bucket, as the runner makes them when the same requests decode
    again: each row's input token the one its last step sampled, still on the device (SRC, its
    carry row), its position one further each step. Padding rows: empty, the null page."""
    from jaxserve.core.buckets import bucket
    from jaxserve.model.kv_cache import AttentionMetadata
    from jaxserve.model.sampler import SamplingMetadata
    from jaxserve.model.step import pack_decode_rows

    if START + steps > runner.max_model_len:
        raise ValueError(f"--tokens {steps}: the lockstep rows end past max_model_len "
                         f"{runner.max_model_len}")
    b = bucket(rows, runner.row_buckets, "decode rows")
    real = np.arange(b) < rows
    lens = real.astype(np.int32)  # [b]
    pages = -(-(START + steps) // runner.page_size)  # each request's
    table = np.zeros((b, runner.pages_per_seq), np.int32)  # [b, pages_per_seq]; page 0: null
    table[:rows, :pages] = 1 + np.arange(rows * pages, dtype=np.int32).reshape(rows, pages)
    calls = []
    for i in range(steps):
        starts = np.where(real, START + i, 0).astype(np.int32)  # [b]
        md = AttentionMetadata(positions=starts[:, None], query_lens=lens,
                               seq_lens=starts + lens, page_table=table)
        sm = SamplingMetadata(temperature=np.zeros((b,), np.float32),
                              top_k=np.full((b,), runner.model_config.vocab_size, np.int32),
                              top_p=np.ones((b,), np.float32), seeds=np.zeros((b,), np.uint32),
                              positions=starts + lens, logprobs=np.zeros((b,), bool))
        src = np.where(real, np.arange(b) if i else -1, -1).astype(np.int32)  # carry 0's row
        calls.append(pack_decode_rows(np.ones((b,), np.int32), src, md, sm))
    return calls


def run_steps(runner, calls: list[np.ndarray]) -> float:
    """Seconds for the decode calls, each dispatched before the last one's tokens are read
    (as the engine overlaps them), the KV pages donated and rebound."""
    import jax
    import jax.numpy as jnp

    with jax.default_device(runner.local_device):  # (the runner's dispatch does the same)
        zeros = carry = jax.device_put(jnp.zeros((runner.carry_size,), jnp.int32),
                                       runner.placement)  # committed, as the runner's carries
        last = None
        start = time.perf_counter()
        for rows in calls:
            packed, carry, runner.kv = runner.fns.decode(runner.weights, runner.kv, rows,
                                                         carry, zeros, steps=1)
            if last is not None:
                np.asarray(last)
            last = packed
        np.asarray(last)
        return time.perf_counter() - start


# -- (b) served by `jaxserve serve` -------------------------------------------------------------


@contextlib.contextmanager
def serving(model: str, num_processes: int, log_dir: Path):
    """`jaxserve serve` as one process of 4 devices or `num_processes` of 4 / n each; yields
    its URL once /health answers."""
    port, coordinator = _port(), _port()
    pids = list(reversed(range(num_processes)))  # process 0, the server, last
    commands = [[sys.executable, "-m", "jaxserve.cli", "serve", model, *flags(ENGINE),
                 *(["--port", str(port)] if pid == 0 else []),
                 *group_flags(num_processes, coordinator, pid)] for pid in pids]
    logs = [log_dir / f"{num_processes}-{pid}.log" for pid in pids]
    with launched(commands, num_processes, logs) as procs:
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
                        help="the processes' logs (default: a new temporary directory)")
    # one process of (a), as this script starts it
    parser.add_argument("--lockstep-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--coordinator-address", help=argparse.SUPPRESS)
    parser.add_argument("--num-processes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lockstep_process:
        lockstep_process(args)
        return
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="jaxserve-multi-host-"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[int, int], tuple[float, float]] = {}
    for processes in (1, 2):
        steps = lockstep(args.model, processes, args, args.log_dir)
        with serving(args.model, processes, args.log_dir) as url:
            per_token_ms(url, 1, 8)  # the first request's own costs (its prompt's cache)
            for rows in args.rows:
                results[processes, rows] = (steps[rows], min(
                    per_token_ms(url, rows, args.tokens) for _ in range(args.rounds)))
    print(f"{Path(args.model).name}, tp=4, {args.tokens} greedy tokens a request, best of "
          f"{args.rounds}: ms per step (a served request's ms per output token)")
    print(f"{'setup':<28}{'rows':>5}{'lockstep (a)':>14}{'served (b)':>12}{'control b-a':>13}"
          f"{'per token':>11}")
    for processes in (1, 2):
        setup = ("1 process, 4 devices" if processes == 1
                 else f"{processes} processes, {4 // processes} devices each")
        for rows in args.rows:
            a, b = results[processes, rows]
            print(f"{setup:<28}{rows:>5}{a:>14.3f}{b:>12.3f}{b - a:>13.3f}"
                  f"{(b - a) / rows:>11.3f}")


if __name__ == "__main__":
    main()
