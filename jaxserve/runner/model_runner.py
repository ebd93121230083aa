"""The only place that touches both worlds: a SchedulerOutput in, padded device arrays, tokens out.

An iteration dispatches one jitted call for the decode rows (one token each, `decode_steps`
steps in one dispatch) and one or a few for the prompt chunks, grouped by length
(`core.buckets.prefill_calls`). Rows are padded to buckets so every shape is compiled once, at
start-up:

    decode:  B = smallest row bucket >= rows (powers of two from 2 up to max_num_seqs, or
             config.row_buckets), C = 1; a static/dynamic batch keeps the B it started with
             until it ends
    prefill: per call, B as above or 1, C = smallest prefill_chunk_sizes entry >= its longest
             chunk; a chunk that wants prompt logprobs runs as a call of its own (B = 1)
    ragged:  where the backend has ragged calls (the cpu and tpu attention;
             config.ragged_prefill), the other prompt chunks packed one after another into one
             row of T tokens, T = smallest ragged token bucket that holds them
             (core.buckets.ragged_calls): no row pads to a chunk bucket. In an iteration
             that also decodes (one step), the decode rows join that call as rows of one
             token: the weights are read once for both. Its head samples B rows, the row
             bucket of its rows (model and head are separate calls: T + B shapes, not T x B)

A call holding a row with sampler controls (penalties, logit_bias, min_p, a token mask:
structured output, allowed_token_ids, bad_words, min_tokens) dispatches the model without its
head; `finish`, which the engine loop calls once the previous iteration is read, makes each
such row's mask on the host and dispatches the head (model/step.py). Such rows decode one step
per dispatch; their slots' token counts and logit_bias live on the device
(sampler_controls.py).

The host arrays persist across steps (InputBatch): each running request holds a slot, written
in full when it joins and then only where it changed (pages appended); a call's padded arrays are
gathered from the slots. `dispatch` returns at once (the device runs on, the packed results start
copying to the host); `collect` waits for them. The engine dispatches iteration t+1 before
collecting iteration t. Each kind of call's arrays and dispatch are calls.py's; the start-up
compile of every shape is warmup.py's.
"""

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import monitoring
from jax.sharding import NamedSharding

from jaxserve.backends import select_backend
from jaxserve.config.engine import EngineConfig, compute_dtype, kv_cache_dtype
from jaxserve.config.model import ModelConfig
from jaxserve.core.buckets import (
    prefill_calls,
    prefill_row_buckets,
    ragged_calls,
    ragged_token_buckets,
)
from jaxserve.core.scheduler_output import ScheduledChunk, SchedulerOutput
from jaxserve.model.kv_cache import KVCache
from jaxserve.model.llama import rope_tables, stack_layers
from jaxserve.model.loader import abstract_state, load_state, state_bytes
from jaxserve.model.lora import attach_banks
from jaxserve.model.quant import array_bytes
from jaxserve.model.step import make_step_fns
from jaxserve.parallel.sharding import (
    MODEL_AXIS,
    ShardPlacement,
    Shards,
    check_tensor_parallel,
    kv_heads_per_device,
    kv_spec,
    make_mesh,
    repeat_kv_heads,
    shard_state,
)
from jaxserve.request import Request, Samples
from jaxserve.runner.calls import StepCalls
from jaxserve.runner.compile_only import CompilingFns, abstractly, placed
from jaxserve.runner.draft_runner import DraftRunner
from jaxserve.runner.inflight import Inflight, read_results
from jaxserve.runner.input_batch import InputBatch
from jaxserve.runner.lora_slots import LoraSlots, bank_leaves
from jaxserve.runner.sampler_controls import SamplerControls
from jaxserve.runner.warmup import Warmup

log = logging.getLogger("jaxserve")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_dispatching = threading.local()  # .runner: the ModelRunner whose step this thread is running


def _count_compiles(event: str, duration: float, **_) -> None:
    """Counts XLA compiles against the runner dispatching on this thread (compiles happen
    synchronously inside the jitted call), so other engines and stray ops are not counted."""
    runner = getattr(_dispatching, "runner", None)
    if runner is not None and event == "/jax/core/compile/backend_compile_duration":
        runner.num_compilations += 1


monitoring.register_event_duration_secs_listener(_count_compiles)


def enable_compilation_cache(path: str | None) -> None:
    """JAX's persistent compilation cache (every compile cached), so restarts are fast."""
    cache = path or os.environ.get("JAXSERVE_CACHE_DIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxserve" / "xla")
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


class ModelRunner(StepCalls, Warmup):
    """Owns the weights, the KV pages and the jitted step functions."""

    def __init__(self, model_path: str | Path | None, model_config: ModelConfig,
                 config: EngineConfig, draft_path: Path | None = None,
                 devices: Sequence[jax.Device] | None = None, compile_only: bool = False):
        """`draft_path`: the draft model of speculative_config's draft_model (checked by the
        engine to share the model's vocabulary). `devices`: the tensor_parallel_size devices
        this runner's arrays live on (a data-parallel replica's, see replica_devices); None:
        the first ones. `compile_only`: the devices are a target's compile-only ones
        (compile_only.py): nothing is read or allocated, `warmup` compiles every step and
        `fns.compiled` holds what XLA said of each."""
        self.compile_only = compile_only
        tp = config.tensor_parallel_size
        self.devices = tuple(jax.devices()[:tp] if devices is None else devices)
        if len(self.devices) != tp:
            raise ValueError(f"tensor_parallel_size {tp}: the runner was given "
                             f"{len(self.devices)} devices")
        # whatever is made without a placement (the weights of one device, the backend's
        # packed panels) is made on this runner's first device of this process (a mesh may
        # span several processes: jaxserve/parallel/distributed.py)
        self.local_device = next(d for d in self.devices
                                 if d.process_index == jax.process_index())
        # (a compile-only device runs nothing: it is never the default device)
        with contextlib.nullcontext() if compile_only else jax.default_device(self.local_device):
            self._build(model_path, model_config, config, draft_path)

    def _build(self, model_path: str | Path | None, model_config: ModelConfig,
               config: EngineConfig, draft_path: Path | None) -> None:
        compile_only = self.compile_only
        self.model_config = model_config
        self.config = config
        if config.max_top_logprobs > model_config.vocab_size:  # before loading: top_k fails
            raise ValueError(f"max_top_logprobs {config.max_top_logprobs} exceeds the model's "
                             f"vocabulary of {model_config.vocab_size}")
        self.max_model_len = config.resolve_max_model_len(model_config)
        self.platform = self.devices[0].platform  # the target's, where not this machine's
        dtype = compute_dtype(config.dtype, model_config.dtype, self.platform,
                              model_config.num_params, config.kv_cache_bytes_cpu)
        if dtype != model_config.dtype and config.dtype == "auto":
            log.info("the checkpoint is %s; computing in %s on the CPU, where 16-bit matmuls "
                     "are slow (dtype=%s keeps it)", model_config.dtype, dtype,
                     model_config.dtype)
        self.dtype = DTYPES[dtype]
        # the backend: chosen once, handed to the jitted steps as a static argument
        self.backend = select_backend(config.attention_impl, config.matmul_impl, dtype,
                                      model_config.head_dim, config.page_size, self.platform,
                                      model_config.num_heads, model_config.num_kv_heads,
                                      self.devices[0])
        self.kv_dtype_name = kv_cache_dtype(dtype, self.platform, self.attention_impl,
                                            config.kv_cache_dtype)
        # the pool's array dtype: a bfloat16 pool on the CPU is held as its bits (uint16)
        self.kv_dtype = self.backend.attention.pool_dtype(self.kv_dtype_name)
        if not compile_only:  # (a compile-only executable cannot be stored and loaded here)
            enable_compilation_cache(config.compilation_cache_dir)
        start = time.perf_counter()
        tp = self.tensor_parallel_size = config.tensor_parallel_size
        experts = config.enable_expert_parallel
        check_tensor_parallel(model_config, tp, len(self.devices) if compile_only
                              else len(jax.devices()), experts)
        mesh = make_mesh(self.devices) if tp > 1 else None
        place = ShardPlacement(mesh, model_config, tp, experts) if mesh else None
        if compile_only:  # the weights' shapes where they would live: nothing read
            self.graphdef, self.state = abstract_state(model_config, self.dtype, place)
        else:
            self.graphdef, self.state = load_state(
                model_path, model_config, self.dtype, config.load_format, config.seed, place)
        # weight transforms: run, or traced for their shapes only
        transform = abstractly if compile_only else lambda fn, g, s: fn(g, s)
        if config.enable_lora:  # every layer's banks, zeros until an adapter takes a slot
            def with_banks(graphdef, state):
                model = nnx.merge(graphdef, state)
                attach_banks(model, config.max_loras, config.max_lora_rank)
                return nnx.split(model)

            self.graphdef, self.state = transform(with_banks, self.graphdef, self.state)
        if tp == 1:  # split, the kernels take each shard's weights as they are
            self.graphdef, self.state = transform(self.backend.ops.pack_weights, self.graphdef,
                                                  self.state)
        self.scan_layers = (self.backend.ops.scan_layers if config.scan_layers is None
                            else config.scan_layers)
        if not model_config.uniform_layers:  # sliding-window and full layers: unrolled
            if config.scan_layers:
                raise ValueError("scan_layers: the model's layers differ (sliding-window and "
                                 "full attention), so they cannot be stacked; leave it unset")
            self.scan_layers = False
        if self.scan_layers:  # one layer compiled, whatever the depth
            self.graphdef, self.state = transform(
                functools.partial(stack_layers, consume=not compile_only), self.graphdef,
                self.state)
        if compile_only and mesh is None:  # (traced transforms give shapes without a place)
            self.state = self._put(self.state, self.devices[0])
        self.shards = None
        if tp > 1:  # each device its part of every split weight (jaxserve/parallel/sharding.py)
            self.backend = replace(self.backend, model_axis=MODEL_AXIS)
            if compile_only:
                self.state = jax.eval_shape(lambda s: repeat_kv_heads(s, model_config, tp),
                                            self.state)
            else:
                self.state = repeat_kv_heads(self.state, model_config, tp)
            self.state, weight_specs = shard_state(self.state, mesh, experts, self._put)
        log.info("weights: %.1f MiB (%s%s) in %.1f s; backend %s (attention %s, matmul %s, "
                 "layers %s)", state_bytes(self.state) / 2**20, jnp.dtype(self.dtype).name,
                 "" if model_config.quantization is None else
                 f", linear layers {model_config.quantization}",
                 time.perf_counter() - start, self.backend.name, self.attention_impl,
                 self.matmul_impl, "scanned" if self.scan_layers else "unrolled")
        self.page_size = config.page_size
        spec = config.speculative_config
        self.num_spec_tokens = k = 0 if spec is None else spec.num_speculative_tokens
        # the verification call's widths (1 + drafts): prompt lookup's rows propose 0..k
        # tokens, padded to powers of two and k + 1; a draft model's always k
        self.verify_widths = () if not k else (k + 1,) if spec.method == "draft_model" else (
            tuple(sorted({2**i for i in range(1, (k + 1).bit_length()) if 2**i < k + 1}
                         | {k + 1})))
        self.pages_per_seq = config.pages_per_seq(self.max_model_len)
        self.num_pages = config.num_pages or self._pages_that_fit()
        if self.num_pages - 1 < self.pages_per_seq:
            raise ValueError(
                f"num_pages {self.num_pages} holds fewer than the {self.pages_per_seq} pages one "
                f"sequence of max_model_len {self.max_model_len} needs (page 0 is the null page): "
                "raise num_pages or lower max_model_len")
        m = model_config
        kv_heads = m.num_kv_heads if tp == 1 else kv_heads_per_device(m, tp) * tp
        make_kv = functools.partial(self.backend.attention.zeros, m.num_layers, self.num_pages,
                                    self.page_size, kv_heads, m.head_dim, self.kv_dtype_name)
        if tp > 1:  # made in place, each device its KV heads
            spec = kv_spec(jax.eval_shape(make_kv))
            self.shards = Shards(mesh, weight_specs, spec)
            make_kv = jax.jit(make_kv, out_shardings=jax.tree.map(
                lambda p: NamedSharding(mesh, p), spec))
            self.kv = jax.eval_shape(make_kv) if compile_only else make_kv()
        else:  # committed, like the caches the steps return (see _zeros below)
            self.kv = self._put(jax.eval_shape(make_kv) if compile_only else make_kv(),
                                self.devices[0])
        if tp > 1:
            weights, pages = (sum(array_bytes(a.sharding.shard_shape(a.shape), a.dtype)
                                  for a in arrays)
                              for arrays in (jax.tree.leaves(self.state), self.kv.pools))
            log.info("tensor parallel over %d devices: %.1f MiB of weights and %.1f MiB of KV "
                     "pages on each", tp, weights / 2**20, pages / 2**20)
        # where the arrays every shard holds whole live
        self.placement = self.shards.replicated if self.shards else self.devices[0]
        # Decode rows come in buckets from 2 (powers of two unless config.row_buckets): with a
        # single row, XLA may turn the one-token K/V write into a dynamic-update-slice fused
        # into the attention's read, and copy the pool.
        self.row_buckets = config.decode_row_buckets()
        self.prefill_row_buckets = prefill_row_buckets(self.row_buckets)
        self.chunk_buckets = config.chunk_buckets(self.max_model_len)
        ragged = self.backend.attention.ragged_calls
        if config.ragged_prefill and not ragged:
            raise ValueError(f"ragged_prefill runs on the cpu or tpu attention, not "
                             f"{self.attention_impl!r}: leave it None (auto) or false")
        self.ragged = config.ragged_prefill is not False and ragged
        self.token_buckets = ragged_token_buckets(self.chunk_buckets,
                                                  config.max_num_batched_tokens)
        self.carry_size = self.row_buckets[-1]
        self.mixed_calls = self.ragged  # decode rows ride in a mixed iteration's ragged call
        # what the jitted steps take: the state's arrays and the RoPE tables
        self.weights = (jax.tree.leaves(self.state),
                        self._put(rope_tables(model_config, self.max_model_len, self.dtype),
                                  self.placement))
        self.loras = None if not config.enable_lora else LoraSlots(
            model_config, config.max_loras, config.max_lora_rank, config.max_cpu_loras,
            bank_leaves([path for path, _ in jax.tree_util.tree_leaves_with_path(self.state)]),
            tp)
        if self.loras is not None and not compile_only and tp == 1:  # (split ones are placed)
            self.weights = (self.loras.commit(self.weights[0], self.devices[0]), self.weights[1])
        self.fns = make_step_fns(self.graphdef, jax.tree.structure(self.state), self.backend,
                                 config.max_top_logprobs, self.carry_size, self.shards)
        # committed to the device like the step outputs that replace it: jit keys its cache on
        # committedness, so an uncommitted zeros would compile every step a second time
        self._zeros = self._put(jnp.zeros((self.carry_size,), jnp.int32), self.placement)
        self._carries = (self._zeros, self._zeros)
        # the last iteration's rows that sampled into the carries: its decode call's request
        # ids (carry 0, row i) and its other calls' chunks (carry 1, row i); `_carry_rows`
        # maps them, when a step needs it
        self._carried: tuple[list[str], list[ScheduledChunk]] = ([], [])
        self._carry_map: dict[str, int] | None = {}
        # the requests of the last iteration's decode call, in its row order ([]: it had none)
        self._decode_requests: list[Request] = []
        self.input_batch = InputBatch(self.pages_per_seq, model_config.vocab_size,
                                      config.max_num_seqs,
                                      None if self.loras is None else self.loras.slot)
        self.draft = None
        if draft_path is not None:
            if compile_only:
                raise ValueError("speculative_config's draft_model: compiling for a target "
                                 "without its device takes the model alone (ngram works)")
            if tp > 1:
                raise ValueError("speculative_config's draft_model runs on one device: leave "
                                 "tensor_parallel_size 1 with it (ngram works on a mesh)")
            draft = ModelConfig.from_hf_dir(draft_path)
            backend = select_backend(config.attention_impl, config.matmul_impl, dtype,
                                     draft.head_dim, config.page_size, self.platform,
                                     draft.num_heads, draft.num_kv_heads)
            self.draft = DraftRunner(
                draft_path, draft, dtype=self.dtype, page_size=self.page_size, backend=backend,
                kv_dtype_name=kv_cache_dtype(dtype, self.platform, backend.attention.name,
                                             config.kv_cache_dtype),
                num_pages=self.num_pages,
                max_model_len=self.max_model_len, chunk_buckets=self.chunk_buckets,
                k=self.num_spec_tokens, placement=self.placement)
        # per slot: the controlled requests' token counts, prompt tokens and logit_bias
        self.controls = SamplerControls(model_config.vocab_size, self.input_batch.num_slots,
                                        self.placement, self._put)
        if compile_only:  # each step compiles when the warm-up calls it
            self.fns = CompilingFns(self.fns, self.platform, self.devices[0], self.placement)
        self.num_compilations = 0  # XLA compiles while this runner dispatched
        self._compiles_at_warmup = 0

    def _put(self, tree, where):
        """jax.device_put, or (compile only) the arrays' shapes where they would be."""
        if self.compile_only:
            return jax.tree.map(lambda x: placed(x, where), tree)
        return jax.device_put(tree, where)

    @property
    def attention_impl(self) -> str:  # what reports call the backend's kernels
        return self.backend.attention.name

    @property
    def matmul_impl(self) -> str:  # "xla+fp8": fp8 weights meet fp8 activations (Ops.native_fp8)
        ops = self.backend.ops
        fp8 = ops.native_fp8 and self.model_config.quantization == "fp8"
        return ops.name + ("+fp8" if fp8 else "")

    @property
    def num_compilations_after_warmup(self) -> int:
        return self.num_compilations - self._compiles_at_warmup

    @contextlib.contextmanager
    def _counting(self):
        _dispatching.runner = self
        try:
            with (contextlib.nullcontext() if self.compile_only  # (CompilingFns sets it)
                  else jax.default_device(self.local_device)):  # a replica's arrays on its devices
                yield
        finally:
            _dispatching.runner = None

    @property
    def weight_bytes(self) -> int:
        return state_bytes(self.state)

    @property
    def sampler_state_bytes(self) -> int:
        return self.controls.nbytes

    @property
    def kv_bytes_per_page(self) -> int:
        """A page of every layer, all devices' shares together (KV heads repeated to one a
        device where the model has fewer than tensor_parallel_size)."""
        m, tp = self.model_config, self.tensor_parallel_size
        heads = m.num_kv_heads if tp == 1 else kv_heads_per_device(m, tp) * tp
        return KVCache.bytes_per_page(m.num_layers, self.page_size, heads,
                                      self.backend.attention.pool_head_dim(m.head_dim),
                                      self.kv_dtype)

    def _pages_that_fit(self) -> int:
        stats = self.devices[0].memory_stats() if self.platform in ("gpu", "tpu") else None
        # a device's free memory holds its share of each page: tp of them, a whole page
        free = (stats["bytes_limit"] - stats["bytes_in_use"]) * self.tensor_parallel_size if (
            stats) else self.config.kv_cache_bytes_cpu
        pages = int(free * self.config.kv_cache_memory_fraction) // self.kv_bytes_per_page
        if pages < 2:
            raise ValueError(f"no room for the KV cache: {free} bytes free, "
                             f"{self.kv_bytes_per_page} per page")
        return pages

    # -- one iteration -----------------------------------------------------------------------

    def dispatch(self, out: SchedulerOutput) -> Inflight:
        """Start the iteration's device work and return without waiting for it."""
        with self._counting():
            return self._dispatch(out)

    def _dispatch(self, out: SchedulerOutput) -> Inflight:
        flight = Inflight()
        carries = [self._zeros, self._zeros]
        if self.loras is not None:  # the step's adapters in device slots
            leaves = self.loras.assign([c.request for c in out.chunks], self.weights[0])
            self.weights = (leaves, self.weights[1])
        self.input_batch.update(out.chunks)
        if self.input_batch.written:
            self.controls.write(self.fns, self.input_batch)
        if out.decode_only:
            decode, prefill, verify = out.chunks, [], []
        else:
            decode, prefill, verify = [], [], []
            for c in out.chunks:
                (verify if c.draft is not None else decode if c.num_tokens == 1
                 else prefill).append(c)
        if verify:
            flight.verify_chunks = verify
            flight.verify_packed = self._dispatch_verify(verify)
        alone = [c.request.params.prompt_logprobs is not None for c in prefill]
        packed = [c for c, a in zip(prefill, alone, strict=True) if not a] if self.ragged else []
        # a mixed iteration's decode rows join its ragged call: one pass over the weights for
        # both (a static batch's finished rows stay in it as padding tokens)
        mixed_tokens = (max(len(decode), out.batch_rows)
                        + sum(c.num_tokens for c in packed))
        mixed = bool(decode and packed and out.decode_steps == 1 and self.mixed_calls
                     and mixed_tokens <= self.token_buckets[-1])
        if decode and not mixed:
            flight.decode_chunks = decode
            requests = (self.input_batch.requests if decode is out.chunks
                        else [c.request for c in decode])
            # the last iteration's decode rows again, in its order (most steps)?
            again = requests == self._decode_requests  # (identity: no Request.__eq__)
            flight.decode_ids = (self._carried[0] if again
                                 else [r.request_id for r in requests])
            flight.decode_packed, carries[0] = self._dispatch_decode(
                decode, again, max(len(decode), out.batch_rows), out.decode_steps, flight)
        # the rows the iteration's other calls run, in order: row i's token goes to carry 1 [i]
        order = (decode if mixed else []) + prefill
        alone = [False] * (len(order) - len(prefill)) + alone
        if self.ragged:  # chunks wanting prompt logprobs run alone, the rest packed
            rest = [i for i, a in enumerate(alone) if not a]
            calls = [[i] for i, a in enumerate(alone) if a]
            if mixed:
                ragged = [(rest, next(t for t in self.token_buckets if t >= mixed_tokens))]
            else:
                ragged = [([rest[j] for j in group], tokens) for group, tokens in ragged_calls(
                    [order[i].num_tokens for i in rest], self.token_buckets, self.carry_size)]
            for rows, tokens in ragged:
                call, carries[1] = self._dispatch_ragged([order[i] for i in rows], rows, tokens,
                                                         carries[1], flight)
                flight.prefills.append(call)
        else:
            calls = prefill_calls([c.num_tokens for c in order], alone,
                                  self.prefill_row_buckets, self.chunk_buckets)
        for group in calls:
            call, carries[1] = self._dispatch_prefill([order[i] for i in group], group,
                                                      carries[1], flight)
            flight.prefills.append(call)
        self._carries, self._carried, self._carry_map = tuple(carries), (
            flight.decode_ids, order), None
        self._decode_requests = requests if decode and not mixed else []
        if self.platform != "cpu":  # (on the CPU the results are in host memory already)
            arrays = [flight.decode_packed, flight.verify_packed] + [
                a for p in flight.prefills for a in (p.packed, p.prompt)]
            for array in arrays:
                if array is not None:
                    array.copy_to_host_async()
        return flight

    def finish(self, flight: Inflight,
               bitmasks: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """Sample the controlled calls of a dispatched iteration: called once the host holds
        every token sampled before it (the engine loop calls it after reading the previous
        iteration), so each row's mask is current. The device ran their model meanwhile.
        Returns each call's token bitmask; `bitmasks`: use these (what process 0's runner
        used, jaxserve/parallel/distributed.py) instead of the requests' own masks."""
        if not flight.heads:
            return []
        carries = list(self._carries)
        used = []
        with self._counting():
            for i, head in enumerate(flight.heads):
                bitmask = self.controls.bitmask(head) if bitmasks is None else bitmasks[i]
                used.append(bitmask)
                packed, carries[head.carry] = self.controls.sample(
                    self.fns, self.weights, head, carries[head.carry], self.input_batch,
                    bitmask)
                if head.call is None:  # [B, W]: one step (collect reads it as [1, B, W])
                    flight.decode_packed = packed
                else:
                    head.call.packed = packed
        flight.heads = []
        self._carries = tuple(carries)
        return used

    def collect(self, flight: Inflight) -> dict[str, Samples]:
        """Wait for an iteration's results: the tokens each request sampled."""
        def host(array):
            return None if array is None else np.asarray(array)

        return read_results(flight, host(flight.decode_packed), host(flight.verify_packed),
                            [(np.asarray(call.packed), host(call.prompt))
                             for call in flight.prefills])
