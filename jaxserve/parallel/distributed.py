"""Several hosts: one engine over every process's devices, through JAX's own multi-host runtime.

    jaxserve serve MODEL -tp 4 --coordinator-address HOST:PORT --num-processes 2 --process-id 0
    jaxserve serve MODEL -tp 4 --coordinator-address HOST:PORT --num-processes 2 --process-id 1

`jax.distributed.initialize` joins the processes (on CPUs their collectives go through gloo).
With `-dp D` the processes split into D data-parallel replicas of num_processes / D each
(`Group.arrange`), each replica a tensor-parallel model over its processes' devices; without,
one model spans every device. Process 0, the leader, runs the server and every replica's
scheduler; the other processes, followers, run only their replica's model runner, built from
the same model and options, and replay the leader's calls for it: JAX's multi-controller model
needs every process of a computation to make the same jitted calls in the same order, and the
runner's calls follow from what it is given (jaxserve/parallel/runners.py).

The leader sends each call down a TCP connection to each follower (`Group.publish`: a
length-prefixed pickle; the leader's address travels once through the coordination service's
key-value store, and every follower connects as soon as the processes agree): the scheduler
output as plain data (jaxserve/parallel/encoding.py), each request's state sent once and then
only what it appended. A replica on other processes answers down the same connection
(`reply`, `answer`). The store keeps the start-up, the heartbeats and the errors: a call
through it cost a gRPC round trip or two (bench/multi_host.py).

Every process writes a heartbeat to the store and watches those it needs: one that stops
(killed, or failed with an error it wrote there) is lost within `LOST_AFTER_S`. A follower
stops when the leader or a process of its own replica is lost; the leader, when a process of
its own replica is: it fails its requests with an error naming the lost process and exits
non-zero, so nothing hangs in a collective that will never complete. A process of another
replica lost writes that replica off (`write_off`): its requests fail with a 503, the other
replicas serve on (JAX's recoverability keeps the coordination service up without it).

Not yet: a draft model across processes.
"""

import contextlib
import logging
import os
import pickle
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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


def initialize(processes: Processes, timeout_s: int = 120, replicas: int = 1) -> "Group":
    """Join the other processes (jax.distributed), before anything else touches a device.
    `replicas` above 1: a process lost stops only its data-parallel replica, so the
    coordination service must not take the others down with it (JAX's recoverability)."""
    global _state
    import jax

    if replicas > 1:
        jax.config.update("jax_enable_recoverability", True)
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
    """The coordination service's key-value store and the leader's channel, as the processes
    serving one engine use them."""

    def __init__(self, processes: Processes, client):
        self.processes = processes
        self.client = client
        self._stop = threading.Event()
        self._answered = time.monotonic()  # when the store last answered this process's beat
        self._server: socket.socket | None = None  # the leader's, until its followers connect
        self._conns: dict[int, socket.socket] | None = None  # the leader's, to each process
        self._leader: socket.socket | None = None  # a follower's, to the leader
        # the data-parallel replicas' processes (arrange): one replica of every process first
        self.replicas = [list(range(processes.num_processes))]
        # the leader's: processes of replicas lost while it serves on -> what happened
        self.written_off: dict[int, str] = {}
        # the leader's server sets it: what fails the requests when a process is lost
        self.fail_requests: Callable[[BaseException], None] | None = None

    @property
    def others(self) -> list[int]:
        me = self.processes.process_id
        return [p for p in range(self.processes.num_processes) if p != me]

    def arrange(self, data_parallel_size: int) -> None:
        """The processes of each data-parallel replica: num_processes / dp consecutive ones
        (replica 0 holds the leader); a ValueError where they do not divide."""
        n, dp = self.processes.num_processes, data_parallel_size
        if n % dp:
            raise ValueError(f"data_parallel_size {dp} across {n} processes: each replica "
                             f"runs on processes of its own, so {n} must be a multiple of {dp}")
        k = n // dp
        self.replicas = [list(range(r * k, (r + 1) * k)) for r in range(dp)]

    def replica_of(self, process: int) -> int:
        return next(r for r, ps in enumerate(self.replicas) if process in ps)

    # -- the leader's calls, in order ---------------------------------------------------------

    def publish(self, n: int, message: Any, to: list[int] | None = None) -> None:
        """Send call n to processes `to` (None: every other): one length-prefixed pickle down
        each one's TCP connection (the kernel's buffer takes it; the leader never waits on a
        follower)."""
        conns = self._connections()
        data = pickle.dumps((n, message), protocol=pickle.HIGHEST_PROTOCOL)
        frame = len(data).to_bytes(_FRAME, "little") + data
        for p in self.others if to is None else to:
            if p in self.written_off:
                continue
            with contextlib.suppress(OSError):  # a lost process is the watcher's to report
                conns[p].sendall(frame)

    def receive(self, n: int) -> Any:
        """The leader's call n (waits for it; returns None when the leader is lost or this
        process stops)."""
        if self._leader is None:
            self._leader = self._connect_to_leader()
        data = self._frame(self._leader)
        if data is None:
            if not self._stop.is_set():  # the leader's end closed: say so before jax's client
                # aborts this process (it does, naming no process, when process 0's service goes)
                exit_lost("process 0 is lost: its channel to this process closed")
            return None
        got, message = pickle.loads(data)
        if got != n:
            raise RuntimeError(f"the leader's call {got} arrived where {n} was due")
        return message

    def reply(self, message: Any) -> None:
        """A follower's answer to the leader (a replica's results, its facts)."""
        if self._leader is None:
            self._leader = self._connect_to_leader()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._leader.sendall(len(data).to_bytes(_FRAME, "little") + data)

    def answer(self, process: int) -> Any:
        """The leader: process's next reply; None when that process is lost (its replica is
        written off then)."""
        conn = self._connections()[process]
        data = self._frame(conn, lambda: process in self.written_off)
        if data is None:
            self.write_off(self.replica_of(process), f"process {process} is lost: its "
                           "connection to the leader closed")
            return None
        return pickle.loads(data)

    def write_off(self, replica: int, message: str) -> None:
        """The leader serves on without a replica whose process was lost."""
        if any(p in self.written_off for p in self.replicas[replica]):
            return
        log.error("data-parallel replica %d is lost (%s): its requests fail, the other "
                  "replicas serve on", replica, message)
        for p in self.replicas[replica]:
            self.written_off[p] = message

    def lost(self, replica: int) -> str | None:
        """What happened to a replica the leader wrote off; None while it serves."""
        return next((self.written_off[p] for p in self.replicas[replica]
                     if p in self.written_off), None)

    # -- the channel: the leader's calls over TCP, its address in the store ------------------

    def listen(self) -> None:
        """The leader: open the port its followers connect to and publish its address (in
        `agree`, so they connect before the models load)."""
        host = self.processes.coordinator_address.rpartition(":")[0] or "127.0.0.1"
        self._server = socket.create_server(("", 0))
        port = self._server.getsockname()[1]
        self.client.key_value_set(f"{_PREFIX}/channel", f"{host}:{port}")

    def _connections(self) -> dict[int, socket.socket]:
        if self._conns is None:
            self._conns = self._accept_followers()
        return self._conns

    def _accept_followers(self) -> dict[int, socket.socket]:
        """Each follower's connection (it sends its id first)."""
        conns: dict[int, socket.socket] = {}
        self._server.settimeout(CONNECT_TIMEOUT_S)
        while len(conns) < len(self.others):
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                missing = sorted(set(self.others) - set(conns))
                raise RuntimeError(f"process(es) {missing} never connected to the leader's "
                                   f"channel within {CONNECT_TIMEOUT_S:.0f} s") from None
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            process = self._read(conn, 4)  # a follower's id; nothing: not one of ours
            if process is None or int.from_bytes(process, "little") not in self.others:
                conn.close()
                continue
            conns[int.from_bytes(process, "little")] = conn
        self._server.close()
        return conns

    def _connect_to_leader(self) -> socket.socket:
        address = self.client.blocking_key_value_get(f"{_PREFIX}/channel",
                                                     int(CONNECT_TIMEOUT_S * 1000))
        host, _, port = address.rpartition(":")
        conn = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(self.processes.process_id.to_bytes(4, "little"))
        return conn

    def _frame(self, conn: socket.socket, gone: Callable[[], bool] = lambda: False
               ) -> bytes | None:
        size = self._read(conn, _FRAME, gone)
        return None if size is None else self._read(conn, int.from_bytes(size, "little"), gone)

    def _read(self, conn: socket.socket, size: int, gone: Callable[[], bool] = lambda: False
              ) -> bytes | None:
        """Exactly `size` bytes, or None when the other end closed, `gone()` or this process
        stops (checked each HEARTBEAT_S while nothing arrives)."""
        parts, left = [], size
        while left:
            try:
                ready, _, _ = select.select([conn], [], [], HEARTBEAT_S)
                if not ready:
                    if self._stop.is_set() or gone():
                        return None
                    continue
                part = conn.recv(min(left, 1 << 20))
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
        # now, before the models load: the leader's first call waits for every follower's
        # connection, and a replica's processes warm up in lockstep with the leader's
        self._leader = self._connect_to_leader()

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
        if not self.processes.is_leader:  # process 0's service, stalled, holds the beats
            threading.Thread(target=self._watch_service, name="jaxserve-service",
                             daemon=True).start()

    def _watch_service(self) -> None:
        """A follower's beats wait on process 0's coordination service with no deadline:
        one unanswered for LOST_AFTER_S (process 0 stopped, or cut off) loses process 0."""
        while not self._stop.wait(HEARTBEAT_S):
            silent = time.monotonic() - self._answered
            if silent > LOST_AFTER_S:
                exit_lost(f"process 0 is lost: its coordination service did not answer for "
                          f"{silent:.0f} s", self.fail_requests)

    def _watch(self) -> None:
        message = self._lost()
        if message is not None:
            exit_lost(message, self.fail_requests)

    def _watched(self) -> list[int]:
        """The processes whose loss stops this one: the leader's replica's and, for a
        follower, the leader and its own replica's. The leader writes the other replicas off."""
        me = self.processes.process_id
        mine = self.replicas[self.replica_of(me)]
        if self.processes.is_leader:
            return [p for p in self.others if p not in self.written_off]
        return [p for p in sorted({0, *mine}) if p != me]

    def _lost(self) -> str | None:
        """Beat and watch until stopped (None) or a process this one needs is lost (what
        happened); the leader writes off another replica whose process is lost."""
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
                values = {p: beats.get(str(p)) for p in self._watched()}
                self._answered = time.monotonic()
            except Exception as error:  # the coordination service is gone, process 0 with it
                if self._stop.is_set():
                    return None
                return f"process 0 is lost (the coordination service is unreachable: {error})"
            for p, value in values.items():
                last, since = seen.get(p, ("", start))
                if value is not None and value.startswith("error"):
                    message = f"process {p} failed: {value[len('error: '):]}"
                elif value is not None and value != last:
                    seen[p] = (value, now)
                    continue
                elif now - since > (LOST_AFTER_S if value is not None else 60.0):
                    message = (f"process {p} is lost: no heartbeat for {now - since:.0f} s"
                               if value is not None else f"process {p} never started")
                else:
                    continue
                replica = self.replica_of(p)
                if not self.processes.is_leader or replica == 0:
                    return message
                self.write_off(replica, message)
            self._stop.wait(HEARTBEAT_S)
        return None

    def end(self, runners: list, code: int) -> None:
        """The leader's server returned `code`. 0, a clean stop: the followers stop (each
        replica's runner tells its processes), then every process shuts jax.distributed down
        together. Else its engine died, most often
        of a collective a lost process broke: the watcher names that process (and exits)
        within LOST_AFTER_S; past it this process exits with `code` without waiting for
        anyone."""
        if code == 0:
            for runner in runners:
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
        if self.written_off:  # jax.distributed's shutdown would wait for them in vain
            log.info("process(es) %s were lost: stopping without jax.distributed's shutdown",
                     sorted(self.written_off))
            logging.shutdown()
            os._exit(0)
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
