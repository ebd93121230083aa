"""Several hosts: one model over every process's devices, through JAX's own multi-host runtime.

    jaxserve serve MODEL -tp 4 --coordinator-address HOST:PORT --num-processes 2 --process-id 0
    jaxserve serve MODEL -tp 4 --coordinator-address HOST:PORT --num-processes 2 --process-id 1

`jax.distributed.initialize` joins the processes (on CPUs their collectives go through gloo);
the tensor-parallel mesh then spans every process's devices. Process 0, the leader, runs the
server, the scheduler and its model runner; each other process, a follower, runs only a model
runner, built from the same model and options, and replays the leader's: JAX's multi-controller
model needs every process to make the same jitted calls in the same order, and the runner's
calls follow from what it is given (each iteration's scheduler output, then its finish).

The leader's runner (`LeaderRunner`) publishes each call before making it, down a TCP
connection to each follower (`Group.publish`: a length-prefixed pickle; the leader's address
travels once through the coordination service's key-value store): the scheduler output as
plain data (`encode`), each request's state sent once and then only what it appended. A
follower decodes it onto stand-ins of the requests (`StandIn`) and makes the same call. The
store keeps the start-up, the heartbeats and the errors: a call through it cost a gRPC round
trip or two (bench/multi_host.py). Every process writes a heartbeat to the store and watches
the others': one that stops (killed, or
failed with an error it wrote there) is lost within `LOST_AFTER_S`, and the others stop: the
leader fails its requests with an error naming the lost process and exits non-zero, so nothing
hangs in a collective that will never complete.

The token masks of structured output, bad_words, min_tokens and allowed_token_ids are made by
the leader alone (its grammars' state) and sent with the call that applies them.

Not yet: data parallelism across processes, a draft model.
"""

import contextlib
import logging
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from jaxserve.core.scheduler_output import ScheduledChunk, SchedulerOutput
from jaxserve.request import Request, SamplingParams

log = logging.getLogger("jaxserve")

HEARTBEAT_S = 0.5  # each process writes its heartbeat this often
LOST_AFTER_S = 5.0  # a process whose heartbeat stood still this long is lost
CONNECT_TIMEOUT_S = 300.0  # followers connect to the leader's channel within it
_FRAME = 8  # a call's length prefix, bytes
_PREFIX = "jaxserve"


@dataclass(frozen=True)
class Processes:
    """This process's place among the processes serving one model."""

    coordinator_address: str
    num_processes: int
    process_id: int

    def __post_init__(self):
        if not isinstance(self.num_processes, int) or self.num_processes < 1:
            raise ValueError(f"num_processes must be a positive integer, got "
                             f"{self.num_processes!r}")
        if not isinstance(self.process_id, int) or not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, {self.num_processes}) "
                             f"(num_processes {self.num_processes}), got {self.process_id!r}")
        host, _, port = self.coordinator_address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"coordinator_address must be HOST:PORT, got "
                             f"{self.coordinator_address!r}")

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0


_state: "Group | None" = None  # this process's group, once initialize() has run


def group() -> "Group | None":
    """The processes this one serves with; None when it serves alone."""
    return _state


def initialize(processes: Processes, timeout_s: int = 120) -> "Group":
    """Join the other processes (jax.distributed), before anything else touches a device."""
    global _state
    import jax

    # the CPU devices' collectives across processes (GPUs' and TPUs' have their own)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(processes.coordinator_address, processes.num_processes,
                               processes.process_id, initialization_timeout=timeout_s)
    from jax._src import distributed as jax_distributed

    _state = Group(processes, jax_distributed.global_state.client)
    log.info("process %d of %d: %d devices here, %d in all", processes.process_id,
             processes.num_processes, len(jax.local_devices()), len(jax.devices()))
    return _state


class Group:
    """The coordination service's key-value store, as the processes of one model use it."""

    def __init__(self, processes: Processes, client):
        self.processes = processes
        self.client = client
        self._stop = threading.Event()
        self._server: socket.socket | None = None  # the leader's, until its followers connect
        self._channel: list[socket.socket] | None = None  # to each follower / to the leader
        # the leader's server sets it: what fails the requests when a process is lost
        self.fail_requests: Callable[[BaseException], None] | None = None

    @property
    def others(self) -> list[int]:
        me = self.processes.process_id
        return [p for p in range(self.processes.num_processes) if p != me]

    # -- the leader's calls, in order ---------------------------------------------------------

    def publish(self, n: int, message: Any) -> None:
        """Send call n to every follower: one length-prefixed pickle down each one's TCP
        connection (the kernel's buffer takes it; the leader never waits on a follower)."""
        if self._channel is None:
            self._channel = self._accept_followers()
        data = pickle.dumps((n, message), protocol=pickle.HIGHEST_PROTOCOL)
        frame = len(data).to_bytes(_FRAME, "little") + data
        for conn in self._channel:
            with contextlib.suppress(OSError):  # a lost process is the watcher's to report
                conn.sendall(frame)

    def receive(self, n: int) -> Any:
        """The leader's call n (waits for it; returns None when the leader is lost or this
        process stops)."""
        if self._channel is None:
            self._channel = [self._connect_to_leader()]
        (conn,) = self._channel
        size = self._read(conn, _FRAME)
        data = None if size is None else self._read(conn, int.from_bytes(size, "little"))
        if data is None:
            return None
        got, message = pickle.loads(data)
        if got != n:
            raise RuntimeError(f"the leader's call {got} arrived where {n} was due")
        return message

    # -- the channel: the leader's calls over TCP, its address in the store ------------------

    def listen(self) -> None:
        """The leader: open the port its followers connect to and publish its address (after
        `agree`, before the warm-up, so they connect while the models compile)."""
        host = self.processes.coordinator_address.rpartition(":")[0] or "127.0.0.1"
        self._server = socket.create_server(("", 0))
        port = self._server.getsockname()[1]
        self.client.key_value_set(f"{_PREFIX}/channel", f"{host}:{port}")

    def _accept_followers(self) -> list[socket.socket]:
        """Each follower's connection, in process order (it sends its id first)."""
        conns: dict[int, socket.socket] = {}
        self._server.settimeout(CONNECT_TIMEOUT_S)
        while len(conns) < len(self.others):
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                missing = sorted(set(self.others) - set(conns))
                raise RuntimeError(f"process(es) {missing} never connected to the leader's "
                                   f"channel within {CONNECT_TIMEOUT_S:.0f} s") from None
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            process = self._read(conn, 4)  # a follower's id; nothing: not one of ours
            if process is None or int.from_bytes(process, "little") not in self.others:
                conn.close()
                continue
            conns[int.from_bytes(process, "little")] = conn
        self._server.close()
        return [conns[p] for p in sorted(conns)]

    def _connect_to_leader(self) -> socket.socket:
        address = self.client.blocking_key_value_get(f"{_PREFIX}/channel",
                                                     int(CONNECT_TIMEOUT_S * 1000))
        host, _, port = address.rpartition(":")
        conn = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(self.processes.process_id.to_bytes(4, "little"))
        conn.settimeout(HEARTBEAT_S)  # reads wake to see this process stopping
        return conn

    def _read(self, conn: socket.socket, size: int) -> bytes | None:
        """Exactly `size` bytes, or None when the other end closed or this process stops."""
        parts, left = [], size
        while left:
            try:
                part = conn.recv(min(left, 1 << 20))
            except TimeoutError:
                if self._stop.is_set():
                    return None
                continue
            except OSError:
                return None
            if not part:
                return None
            parts.append(part)
            left -= len(part)
        return b"".join(parts)

    # -- start-up: the same model and options everywhere --------------------------------------

    def agree(self, what: dict[str, Any]) -> None:
        """Every process publishes what it serves (model, options, process count); a
        ValueError names the first difference from the leader's."""
        me = self.processes.process_id
        self.client.key_value_set_bytes(f"{_PREFIX}/setup/{me}", pickle.dumps(what))
        if self.processes.is_leader:
            self.listen()
            return
        leader = pickle.loads(self.client.blocking_key_value_get_bytes(f"{_PREFIX}/setup/0",
                                                                      120_000))
        leader, what = _flat(leader), _flat(what)
        for key in sorted(set(leader) | set(what)):
            if leader.get(key) != what.get(key):
                raise ValueError(f"process {me} serves {key} {what.get(key)!r}, process 0 "
                                 f"{leader.get(key)!r}: every process must be started with "
                                 "the same model and options")

    # -- liveness ------------------------------------------------------------------------------

    def fail(self, error: BaseException) -> None:
        """Tell the others this process failed (they stop at once instead of waiting out
        LOST_AFTER_S)."""
        me = self.processes.process_id
        self._stop.set()  # this process's heartbeat would overwrite it
        time.sleep(2 * HEARTBEAT_S)
        with contextlib.suppress(Exception):  # the service gone: the others see that too
            self.client.key_value_set(f"{_PREFIX}/alive/{me}", f"error: {error}"[:500],
                                      allow_overwrite=True)

    def watch(self) -> None:
        """Write this process's heartbeat and watch the others' in a daemon thread; when one
        is lost, `exit_lost` (with `fail_requests`, which the leader's server sets)."""
        threading.Thread(target=self._watch, name="jaxserve-heartbeat", daemon=True).start()

    def _watch(self) -> None:
        message = self._lost()
        if message is not None:
            exit_lost(message, self.fail_requests)

    def _lost(self) -> str | None:
        """Beat and watch until stopped (None) or another process is lost (what happened)."""
        me = self.processes.process_id
        start = time.monotonic()
        seen: dict[int, tuple[str, float]] = {}  # process -> (its beat, when it changed)
        beat = 0
        while not self._stop.is_set():
            now = time.monotonic()
            beat += 1
            try:
                self.client.key_value_set(f"{_PREFIX}/alive/{me}", str(beat),
                                          allow_overwrite=True)
                beats = {key.rpartition("/")[2]: value for key, value in
                         self.client.key_value_dir_get(f"{_PREFIX}/alive/")}
                values = {p: beats.get(str(p)) for p in self.others}
            except Exception as error:  # the coordination service is gone, process 0 with it
                if self._stop.is_set():
                    return None
                return f"process 0 is lost (the coordination service is unreachable: {error})"
            for p, value in values.items():
                if value is not None and value.startswith("error"):
                    return f"process {p} failed: {value[len('error: '):]}"
                last, since = seen.get(p, ("", start))
                if value is not None and value != last:
                    seen[p] = (value, now)
                elif now - since > (LOST_AFTER_S if value is not None else 60.0):
                    return (f"process {p} is lost: no heartbeat for {now - since:.0f} s"
                            if value is not None else f"process {p} never started")
            self._stop.wait(HEARTBEAT_S)
        return None

    def end(self, runner: "LeaderRunner", code: int) -> None:
        """The leader's server returned `code`. 0, a clean stop: the followers stop, then
        every process shuts jax.distributed down together. Else its engine died, most often
        of a collective a lost process broke: the watcher names that process (and exits)
        within LOST_AFTER_S; past it this process exits with `code` without waiting for
        anyone."""
        if code == 0:
            runner.stop()
            self.shutdown()
            return
        time.sleep(LOST_AFTER_S + 4 * HEARTBEAT_S)
        self.fail(RuntimeError("process 0's engine died"))
        log.error("the engine died; no process was lost: stopping this process")
        os._exit(code)

    def shutdown(self) -> None:
        """A clean end (the leader's after its stop call, a follower's once it read it): the
        heartbeats stop, then jax.distributed's shutdown, which waits for every process."""
        import jax

        self._stop.set()
        time.sleep(2 * HEARTBEAT_S)  # the watcher's last beat done
        jax.distributed.shutdown()


def _flat(setup: dict[str, Any]) -> dict[str, Any]:
    """The engine options' keys beside the others: a difference names its option."""
    flat = {k: v for k, v in setup.items() if k != "engine options"}
    return flat | setup.get("engine options", {})


def exit_lost(message: str, before: Callable[[BaseException], None] | None = None) -> None:
    """A process of the group is lost: fail what this one holds, say why, exit non-zero."""
    error = RuntimeError(message)
    log.error("%s: stopping this process", message)
    if before is not None:
        try:
            before(error)
        except Exception:
            log.exception("failing the requests")
    print(f"jaxserve: error: {message}", flush=True)
    time.sleep(0.2)  # let the failed requests' responses leave
    os._exit(1)


# -- the scheduler output as plain data -----------------------------------------------------------


@dataclass(eq=False)
class StandIn:
    """A follower's stand-in for a request: what the model runner reads of one (its token
    masks come with the leader's finish call)."""

    request_id: str
    params: SamplingParams
    seed: int
    prompt_ids: list[int]
    output_ids: list[int]
    pages: list[int]
    metrics: SimpleNamespace

    def token_ids(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_ids)
        return (self.prompt_ids[start:end] if end <= n
                else (self.prompt_ids + self.output_ids)[start:end])


class Encoder:
    """The leader's side: a scheduler output as plain data, each request's state sent whole
    the first step it runs after a break and then only what it appended."""

    def __init__(self):
        # request id -> (the request, output ids sent, pages sent, preemptions): the
        # requests of the previous message, as the followers hold them
        self._sent: dict[str, tuple[Request, int, int, int]] = {}

    def encode(self, out: SchedulerOutput) -> dict[str, Any]:
        states, sent = [], {}
        for chunk in out.chunks:
            r = chunk.request
            if r.request_id in sent:
                continue
            known = self._sent.get(r.request_id)
            preemptions = r.metrics.num_preemptions
            if (known is None or known[0] is not r or known[3] != preemptions
                    or len(r.output_ids) < known[1] or len(r.pages) < known[2]):
                states.append((r.request_id, r.params, r.seed, list(r.prompt_ids),
                               list(r.output_ids), list(r.pages), preemptions))
            else:
                states.append((r.request_id, r.output_ids[known[1]:], r.pages[known[2]:]))
            sent[r.request_id] = (r, len(r.output_ids), len(r.pages), preemptions)
        self._sent = sent
        return {"states": states,
                "chunks": [(c.request.request_id, c.start, c.num_tokens, c.num_samples,
                            None if c.draft is None else list(c.draft)) for c in out.chunks],
                "decode_steps": out.decode_steps, "batch_rows": out.batch_rows,
                "speculative": out.speculative}


class Decoder:
    """A follower's side: the leader's messages back into scheduler outputs over stand-ins."""

    def __init__(self):
        self._requests: dict[str, StandIn] = {}

    def decode(self, message: dict[str, Any]) -> SchedulerOutput:
        requests = {}
        for state in message["states"]:
            if len(state) == 3:  # what a request it holds appended
                rid, outputs, pages = state
                request = self._requests[rid]
                request.output_ids += outputs
                request.pages += pages
            else:
                rid, params, seed, prompt, outputs, pages, preemptions = state
                request = StandIn(rid, params, seed, prompt, outputs, pages,
                                  SimpleNamespace(num_preemptions=preemptions))
            requests[rid] = request
        self._requests = requests
        return SchedulerOutput(
            chunks=[ScheduledChunk(requests[rid], start, n, samples, draft)
                    for rid, start, n, samples, draft in message["chunks"]],
            decode_steps=message["decode_steps"], batch_rows=message["batch_rows"],
            speculative=message["speculative"])


class LeaderRunner:
    """The leader's model runner: each call published to the followers, then made."""

    def __init__(self, runner, group: Group):
        self.runner = runner
        self.group = group
        self.encoder = Encoder()
        self._n = 0  # calls published

    def __getattr__(self, name: str):  # the runner's own attributes and reports
        return getattr(self.runner, name)

    def _publish(self, message: tuple) -> None:
        self.group.publish(self._n, message)
        self._n += 1

    def warmup(self, progress: bool = False) -> float:
        return self.runner.warmup(progress=progress)  # each follower warms up alike

    def dispatch(self, out: SchedulerOutput):
        n = self._n
        self._publish(("dispatch", self.encoder.encode(out)))
        return n, self.runner.dispatch(out)

    def finish(self, handle) -> None:
        n, flight = handle
        # the token bitmasks it used (structured output, bad words...: made from this
        # process's grammar state) go with it: sent once the calls are dispatched
        self._publish(("finish", (n, self.runner.finish(flight))))

    def collect(self, handle):
        return self.runner.collect(handle[1])

    def stop(self) -> None:
        self._publish(("stop", None))


def follow(runner, group: Group) -> int:
    """A follower's life after its runner warmed up: replay the leader's calls until it
    stops (0) or is lost (the watchdog exits the process)."""
    decoder = Decoder()
    flights: dict[int, Any] = {}
    n = 0
    while True:
        message = group.receive(n)
        if message is None:
            return 1
        kind, body = message
        if kind == "stop":
            log.info("process 0 stopped: this process stops")
            return 0
        if kind == "dispatch":
            flights[n] = runner.dispatch(decoder.decode(body))
        elif kind == "finish":
            flight, bitmasks = body
            runner.finish(flights.pop(flight), bitmasks)
        n += 1


def check_group(config) -> None:
    """What several processes serve today: one tensor-parallel model over all their devices."""
    import jax

    tp, devices = config.tensor_parallel_size, jax.device_count()
    if tp != devices:
        raise ValueError(f"tensor_parallel_size {tp}: processes serve one model over every "
                         f"process's devices, {devices} in all here")
    if config.data_parallel_size != 1:
        raise ValueError("data_parallel_size > 1 across several processes is not supported "
                         "yet")
    spec = config.speculative_config
    if spec is not None and spec.method == "draft_model":
        raise ValueError("speculative_config's draft_model is not supported across several "
                         "processes yet (ngram is)")


def setup_of(model_path, config) -> dict[str, Any]:
    """What must be the same in every process: the model's config.json, the engine options,
    the number of processes."""
    import dataclasses
    import hashlib
    from pathlib import Path

    text = (Path(model_path) / "config.json").read_bytes()
    return {"model config.json (sha256)": hashlib.sha256(text).hexdigest()[:16],
            "engine options": dataclasses.asdict(config),
            "num_processes": _state.processes.num_processes if _state else 1}
