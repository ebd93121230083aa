"""The host's cost per engine iteration, over a stand-in accelerator (issue 29's yardstick).

    python bench/host_overhead.py                      # 8, 64, 256 sequences; 5 ms steps
    python bench/host_overhead.py --seqs 256 --step-ms 5 --long-tokens 8192

The real LLMEngine, scheduler and runner run a 1-layer, 32-wide Llama (random weights) whose
device work is near zero; each jitted step is followed, on the device's stream, by a host
callback that sleeps `--step-ms` (it waits without using a core, and dispatch stays
asynchronous: the host goes on while the "device" works). Every decode iteration's host time is
split into

    schedule   Scheduler.schedule
    batch      the runner's persistent arrays updated and each call's gathered (metadata,
               sampling arrays)
    dispatch   the jitted calls themselves (launch)
    collect    reading the step's results once they are ready (not the wait for them)
    output     the way out: the output processor (stops, logprobs, detokenizing, outputs), the
               scheduler's update, the engine's own

and the device's idle share is the part of the measured window in which no stand-in step slept.
The launch of the stand-in's own sleep (a second jitted call per step, which a real device does
not need) is timed apart ("stand_in_us_per_iteration") and left out of the host's time.
With `--long-tokens N`, one request generates N tokens alone and the host time of its last
1,024 tokens is compared with its first 1,024 (it should not grow with output length).
Contexts are `--context` tokens long (prompts of that length, then decode).
"""

import argparse
import contextlib
import dataclasses
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.request import SamplingParams

TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32"}
PHASES = ("schedule", "batch", "dispatch", "collect", "output")
WAIT = "wait"  # the host blocked on the device's results: not host work
STAND_IN = "stand-in"  # launching the stand-in's sleep: a real device has no such call
NOT_HOST = (WAIT, STAND_IN)


class Device:
    """The stand-in accelerator. The CPU backend runs its calls in order, each step's real
    (tiny) compute and then its sleep, so it sits idle only between the end of a step and the
    launch of the next: the device's idle time is the sum of those gaps."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self.launches: list[float] = []  # when each step was dispatched
        self.ends: list[float] = []  # when each step's sleep ended
        self._lock = threading.Lock()

        def sleep() -> np.int32:
            time.sleep(self.step_s)
            with self._lock:
                self.ends.append(time.perf_counter())
            return np.int32(0)

        # the step's output waits for the sleep: reading it back waits as for a real device
        self.after = jax.jit(lambda x: x + io_callback(
            sleep, jax.ShapeDtypeStruct((), jnp.int32), ordered=False).astype(x.dtype))

    def idle_in(self, start: float, end: float) -> float:
        """Seconds of [start, end] between a step's end and the next step's launch."""
        with self._lock:
            pairs = list(zip(self.ends, self.launches[1:], strict=False))
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in pairs)


class Timers:
    """Seconds per phase of the current iteration, reset per engine step."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.now = dict.fromkeys((*PHASES, *NOT_HOST), 0.0)
        self.active: set[str] = set()  # phases being timed: a nested call is not counted again

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            if phase in self.active:
                return fn(*args, **kwargs)
            self.active.add(phase)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.now[phase] += time.perf_counter() - start
                self.active.discard(phase)
        return timed


def _model_dir(max_model_len: int) -> Path:
    path = Path(tempfile.mkdtemp(prefix="jaxserve-host-overhead-"))
    config = TINY | {"max_position_embeddings": max_model_len}
    (path / "config.json").write_text(json.dumps(config))
    return path


def build(seqs: int, context: int, step_ms: float, long_tokens: int = 0):
    """An engine over the stand-in device, with every step's timing wrapped."""
    model_len = context + max(long_tokens, 64) + 16
    config = EngineConfig.from_overrides(
        load_format="dummy", max_num_seqs=max(seqs, 2), max_model_len=model_len,
        max_num_batched_tokens=max(2048, seqs), page_size=16,
        num_pages=max(seqs, 2) * (-(-model_len // 16)) + 1,
        prefill_chunk_sizes=(min(512, model_len - 16),))
    engine = LLMEngine(_model_dir(model_len), config)
    device, timers = Device(step_ms / 1000.0), Timers()
    runner = engine.runner
    def launched(fn):  # a jitted step's launch, then the stand-in's sleep after its samples
        step, sleep = timers.wrap("dispatch", fn), timers.wrap(STAND_IN, device.after)

        def call(*args, **kwargs):
            out = step(*args, **kwargs)
            device.launches.append(time.perf_counter())
            return (sleep(out[0]), *out[1:])
        return call

    fns = runner.fns  # the calls that produce samples sleep; ragged's hidden states do not
    runner.fns = dataclasses.replace(
        fns, decode=launched(fns.decode), prefill=launched(fns.prefill),
        prefill_with_prompt_logprobs=launched(fns.prefill_with_prompt_logprobs),
        ragged=timers.wrap("dispatch", fns.ragged), ragged_head=launched(fns.ragged_head))
    batch = runner.input_batch  # the persistent arrays' update, then each call's gather
    batch.update = timers.wrap("batch", batch.update)
    runner._metadata = timers.wrap("batch", runner._metadata)
    runner._sampling = timers.wrap("batch", runner._sampling)
    engine.scheduler.schedule = timers.wrap("schedule", engine.scheduler.schedule)
    collect = runner.collect

    def collect_ready(flight):  # the wait for the device is not host work
        arrays = [flight.decode_packed] + [p.packed for p in flight.prefills]
        timers.wrap("wait", jax.block_until_ready)([a for a in arrays if a is not None])
        return timers.wrap("collect", collect)(flight)
    runner.collect = collect_ready
    # the way out: the output processor (stops, text, outputs) runs inside the engine loop,
    # then the scheduler's update and the engine's own
    processor = engine.core.processor
    processor.update = timers.wrap("output", processor.update)
    engine.scheduler.update = timers.wrap("output", engine.scheduler.update)
    engine._process = timers.wrap("output", engine._process)
    return engine, device, timers


def measure(seqs: int, context: int, step_ms: float, steps: int, seed: int = 0) -> dict:
    engine, device, timers = build(seqs, context, step_ms, long_tokens=steps + 40)
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=steps + 32, temperature=0.0, ignore_eos=True)
    for i in range(seqs):
        engine.add_request(str(i), {"prompt_token_ids": rng.integers(3, 500, context).tolist()},
                           params)
    while any(r.num_to_compute > 1 for r in engine.scheduler.requests.values()) or (
            engine.scheduler.waiting):  # prefill first: measure decode iterations only
        engine.step()
    for _ in range(3):
        engine.step()
    rows, start = [], time.perf_counter()
    for _ in range(steps):
        timers.reset()
        t = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t
        rows.append(timers.now | {"other": total - sum(timers.now.values())})
    end = time.perf_counter()
    per_phase = {k: statistics.median(r[k] for r in rows) * 1e6
                 for k in (*PHASES, "other", *NOT_HOST)}
    host_us = statistics.median(sum(v for k, v in r.items() if k not in NOT_HOST)
                                for r in rows) * 1e6
    idle = device.idle_in(start, end) / (end - start)
    return {"seqs": seqs, "context": context, "step_ms": step_ms, "iterations": steps,
            "host_us_per_iteration": round(host_us, 1),
            "host_us_by_phase": {k: round(v, 1) for k, v in per_phase.items()
                                 if k not in NOT_HOST},
            "wait_us_per_iteration": round(per_phase[WAIT], 1),
            "stand_in_us_per_iteration": round(per_phase[STAND_IN], 1),
            "device_idle_share": round(idle, 4)}


def long_request(tokens: int, step_ms: float) -> dict:
    engine, _, timers = build(1, 16, step_ms, long_tokens=tokens)
    engine.add_request("long", {"prompt_token_ids": list(range(3, 19))},
                       SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    per_token: list[float] = []
    while engine.has_unfinished_requests():
        timers.reset()
        t = time.perf_counter()
        engine.step()
        per_token.append(time.perf_counter() - t - timers.now[WAIT] - timers.now[STAND_IN])
    first, last = sum(per_token[2:1026]), sum(per_token[-1024:])
    return {"tokens": tokens, "host_ms_first_1024": round(first * 1e3, 2),
            "host_ms_last_1024": round(last * 1e3, 2), "last_over_first": round(last / first, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--steps", type=int, default=100, help="decode iterations measured")
    parser.add_argument("--long-tokens", type=int, default=8192,
                        help="one request's output length (0: skip)")
    args = parser.parse_args()
    out = {"jax": jax.__version__, "backend": jax.default_backend(),
           "runs": [measure(n, args.context, args.step_ms, args.steps) for n in args.seqs]}
    if args.long_tokens:
        with contextlib.suppress(KeyboardInterrupt):
            out["long_request"] = long_request(args.long_tokens, args.step_ms)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
