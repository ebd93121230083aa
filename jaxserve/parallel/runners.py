"""The runners of an engine over several processes (jaxserve/parallel/distributed.py).

Each data-parallel replica runs on processes of its own (`Group.arrange`): replica 0 on the
leader's (process 0, which runs the server and every replica's scheduler) and its followers',
replica r on the next num_processes / dp. The leader's engine holds a runner per replica:
- replica 0's `LeaderRunner` publishes each call to its followers, then makes it: every process
  of a tensor-parallel model makes the same jitted calls in the same order;
- another replica's `RemoteRunner` only publishes: that replica's processes make the calls, and
  its first process (the replica's head) sends back what `collect` reads. The leader makes the
  token masks of structured output and the like (its grammars' state) and sends each
  request's row with the call that applies it.
`follow` is a follower's life: the leader's calls, replayed until it stops.
"""

import logging
from typing import Any

from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.parallel.distributed import Group
from jaxserve.parallel.encoding import Decoder, Encoder
from jaxserve.structured.token_masks import chunk_bitmask

log = logging.getLogger("jaxserve")


class ReplicaLostError(RuntimeError):
    """A data-parallel replica on other processes was lost: its requests fail, the rest
    serve on."""


class LeaderRunner:
    """Replica 0's model runner on the leader: each call published to the replica's other
    processes, then made."""

    def __init__(self, runner, group: Group, to: list[int]):
        self.runner = runner
        self.group = group
        self.to = to  # the followers replaying this runner's calls
        self.encoder = Encoder()
        self._n = 0  # calls published

    def __getattr__(self, name: str):  # the runner's own attributes and reports
        return getattr(self.runner, name)

    def _publish(self, message: tuple) -> None:
        self.group.publish(self._n, message, self.to)
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
        self._publish(("stop", sorted(self.group.written_off)))


class RemoteRunner:
    """A replica on other processes, as the leader's engine drives it: calls published to
    its processes, results read back from its head. Its facts (pages, buckets) come from the
    head once its runner is built."""

    def __init__(self, group: Group, replica: int, vocab_size: int):
        self.group = group
        self.replica = replica
        self.to = group.replicas[replica]
        self.head = self.to[0]
        self.vocab_size = vocab_size
        self.encoder = Encoder()
        self._n = 0  # calls published
        self._chunks: dict[int, list] = {}  # a dispatched call's chunks, until finished
        facts = self._answer("facts")
        self.num_pages = facts["num_pages"]
        self.max_model_len = facts["max_model_len"]
        self.chunk_buckets = tuple(facts["chunk_buckets"])
        self.num_compilations_after_warmup = 0
        log.info("replica %d on processes %s: KV pool of %d pages", replica, self.to,
                 self.num_pages - 1)

    def _publish(self, message: tuple) -> int:
        n = self._n
        self.group.publish(n, message, self.to)
        self._n += 1
        return n

    def _answer(self, kind: str) -> dict[str, Any]:
        reply = self.group.answer(self.head)
        if reply is None:
            raise ReplicaLostError(f"data-parallel replica {self.replica} is lost: "
                                   f"{self.group.lost(self.replica)}")
        got, body = reply
        if got != kind:
            raise RuntimeError(f"replica {self.replica}'s {got} arrived where its {kind} "
                               "was due")
        return body

    @property
    def lost(self) -> str | None:
        """What happened to this replica, once it is lost; None while it serves."""
        return self.group.lost(self.replica)

    def warmup(self, progress: bool = False) -> float:
        return self._answer("warm")["seconds"]  # its processes compiled meanwhile

    def dispatch(self, out: SchedulerOutput) -> int:
        n = self._publish(("dispatch", self.encoder.encode(out)))
        self._chunks[n] = out.chunks
        return n

    def finish(self, handle: int) -> None:
        chunks = [c for c in self._chunks.pop(handle)
                  if c.request.token_mask is not None and c.num_samples]
        rows = chunk_bitmask(chunks, self.vocab_size) if chunks else []
        self._publish(("finish_rows", (handle, {c.request.request_id: row
                                               for c, row in zip(chunks, rows, strict=True)})))

    def collect(self, handle: int):
        self._publish(("collect", handle))
        body = self._answer("collected")
        self.num_compilations_after_warmup = body["compilations"]
        return body["results"]

    def stop(self) -> None:
        if self.lost is None:
            self._publish(("stop", sorted(self.group.written_off)))


def follow(runner, group: Group, head: bool = False) -> int:
    """A follower's life after its runner warmed up: replay the leader's calls until it
    stops (0) or is lost (the watchdog exits the process). `head`: this process answers
    for its replica (RemoteRunner), sending back what each collect reads."""
    decoder = Decoder()
    flights: dict[int, Any] = {}
    n = 0
    while True:
        message = group.receive(n)
        if message is None:
            return 1
        kind, body = message
        if kind == "stop":  # with the processes lost meanwhile (no shutdown waits for them)
            log.info("process 0 stopped: this process stops")
            group.written_off.update(dict.fromkeys(body, "lost"))
            return 0
        if kind == "dispatch":
            flights[n] = runner.dispatch(decoder.decode(body))
        elif kind == "finish":  # replica 0's: the bitmasks the leader's runner used
            flight, bitmasks = body
            runner.finish(flights.pop(flight), bitmasks)
        elif kind == "finish_rows":  # another replica's: its requests' rows
            flight, rows = body
            decoder.set_masks(rows)
            runner.finish(flights[flight])
        elif kind == "collect":
            results = runner.collect(flights.pop(body))
            if head:
                group.reply(("collected", {"results": results, "compilations":
                                           runner.num_compilations_after_warmup}))
        n += 1


def check_group(config, group: Group) -> list[list]:
    """What several processes serve: `data_parallel_size` replicas, each one
    tensor-parallel model over the devices of its own processes. Returns each replica's
    devices; a ValueError names what does not fit."""
    import jax

    dp, tp = config.data_parallel_size, config.tensor_parallel_size
    n, devices = group.processes.num_processes, jax.devices()
    group.arrange(dp)
    if dp * tp != len(devices):
        raise ValueError(f"data_parallel_size {dp} x tensor_parallel_size {tp}: processes "
                         f"serve every process's devices, {len(devices)} in all here (with "
                         f"data_parallel_size {dp}, tensor_parallel_size {len(devices) // dp})")
    grid = [[d for d in devices if d.process_index in processes]
            for processes in group.replicas]
    if any(len(row) != tp for row in grid):
        raise ValueError(f"data_parallel_size {dp} over {n} processes: each replica's "
                         f"processes hold {[len(row) for row in grid]} devices, not "
                         f"tensor_parallel_size {tp} each")
    spec = config.speculative_config
    if spec is not None and spec.method == "draft_model":
        raise ValueError("speculative_config's draft_model is not supported across several "
                         "processes yet (ngram is)")
    return grid
