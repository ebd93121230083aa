"""Compile-only: the runner built for devices this machine does not have (an H100, a TPU slice:
XLA's compile-only devices, jaxserve/tools/targets.py), its every step compiled ahead of time
and nothing run.

`ModelRunner(..., compile_only=True)` builds exactly as it would to serve (the target's backend
and kernels, its mesh, the KV pool, the buckets), with every array a `jax.ShapeDtypeStruct`
carrying its sharding instead of memory: no weight is read, no page allocated. Its jitted steps
are wrapped (`CompilingFns`): a call lowers and compiles the step for the arguments' shapes and
shardings, records what XLA says of it (`Compiled`), and returns its outputs' shapes, so the
runner's own warm-up walks every bucket and feeds each step the abstract KV pool the one before
returned, as it does when serving.
"""

import contextlib
import time
from dataclasses import dataclass, fields

import jax
from jax.sharding import Sharding, SingleDeviceSharding

# the custom calls that are our kernels, by platform: Pallas through Triton or Mosaic GPU, JAX's
# Pallas TPU kernel through Mosaic, the C++ kernels through XLA's FFI
KERNEL_CALLS = {"gpu": ('custom_call_target="__gpu$xla.gpu.triton"',
                        'custom_call_target="mosaic_gpu'),
                "tpu": ('custom_call_target="tpu_custom_call"',),
                "cpu": ('custom_call_target="jaxserve_',)}
# XLA options a compile without the device needs: on a GPU, XLA's own sort for the sampler's
# top-k / top-p (CUB's needs scratch sizes measured on a live device)
COMPILER_OPTIONS = {"gpu": {"xla_gpu_enable_cub_radix_sort": False}}
# ... and where XLA refuses a step anyway, the options of a second try, and what they change.
# On a GPU: without a device XLA cannot autotune, and the Triton GEMM's untuned tile for a
# one-row matmul (the lm_head at one row, 8 x 16 output tiles) fails to emit ("Reshape input
# and output shapes must be the same, got 1x16 -> 16x8"); a live GPU's autotuner measures the
# tiles and skips those. The retry gives that step cuBLAS's GEMMs, as the autotuner may too.
RETRY_OPTIONS = {"gpu": ({"xla_gpu_enable_triton_gemm": False}, "cuBLAS GEMMs")}
HOST_CALLS = ("xla_python_cpu_callback", "xla_python_gpu_callback", "xla_ffi_python_cpu_callback",
              "xla_ffi_python_gpu_callback", "SendToHost", "RecvFromHost")


def placed(x, sharding) -> jax.ShapeDtypeStruct:
    """An array's shape and dtype where it would live: `sharding`, or a device's."""
    if not isinstance(sharding, Sharding):
        sharding = SingleDeviceSharding(sharding)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def abstractly(fn, graphdef, state):
    """(graphdef, state) -> fn(graphdef, state) on a state of ShapeDtypeStructs, traced: the
    graph fn returns and its state's shapes (a weight transform that never runs)."""
    out = {}

    def run(s):
        out["graphdef"], s = fn(graphdef, s)
        return s

    state = jax.eval_shape(run, state)
    return out["graphdef"], state


@dataclass
class Compiled:
    """One step shape compiled for the target: what XLA said of it, per device."""

    name: str  # the step and its shape, e.g. decode[b=8,steps=1]
    seconds: float  # lowering and compiling
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int  # the donated inputs' bytes the outputs reuse
    generated_code_bytes: int
    kernels: int  # our kernels' custom calls in the compiled program
    host_calls: int  # host callbacks or transfers inside the step (none belong there)
    all_reduces: int
    flops: float | None  # XLA's cost analysis, where the platform gives one
    bytes_accessed: float | None
    note: str = ""  # what a second try changed (RETRY_OPTIONS), "" if none


def _count(text: str, needles) -> int:
    return sum(text.count(n) for n in needles)


class CompilingFns:
    """A StepFns whose every step, called, compiles instead of running (see the module)."""

    def __init__(self, fns, platform: str, default_device, placement):
        self._platform = platform
        self._device = default_device  # Pallas reads the chip's generation from it
        self._placement = placement  # where a step that failed to compile leaves its outputs
        self.compiled: list[Compiled] = []
        self.failed: dict[str, str] = {}  # step -> XLA's refusal
        for f in fields(fns):
            setattr(self, f.name, self._compiling(f.name, getattr(fns, f.name)))

    def _compiling(self, step: str, fn):
        def call(*args, **static):
            start = time.perf_counter()
            with jax.default_device(self._device):
                lowered = fn.lower(*args, **static)
            shape = ",".join(f"{k}={v}" for k, v in static.items())
            name = f"{step}[{_shape_name(args)}{',' if shape else ''}{shape}]"
            options = COMPILER_OPTIONS.get(self._platform, {})
            retry, note = RETRY_OPTIONS.get(self._platform, (None, ""))
            try:
                compiled = lowered.compile(compiler_options=options)
                note = ""
            except jax.errors.JaxRuntimeError as error:  # the report says which and why
                compiled = None
                if retry is not None:
                    with contextlib.suppress(jax.errors.JaxRuntimeError):
                        compiled = lowered.compile(compiler_options={**options, **retry})
                if compiled is None:
                    self.failed[name] = str(error).splitlines()[0]
                    return jax.tree.map(lambda x: placed(x, self._placement), lowered.out_info)
            seconds = time.perf_counter() - start
            memory = compiled.memory_analysis()
            text = compiled.as_text()
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) and cost else cost
            self.compiled.append(Compiled(
                name, seconds,
                memory.argument_size_in_bytes, memory.output_size_in_bytes,
                memory.temp_size_in_bytes, memory.alias_size_in_bytes,
                memory.generated_code_size_in_bytes,
                _count(text, KERNEL_CALLS.get(self._platform, ())), _count(text, HOST_CALLS),
                text.count(" all-reduce(") + text.count(" all-reduce-start("),
                cost.get("flops") if cost else None,
                cost.get("bytes accessed") if cost else None, note))
            return jax.tree.map(placed, lowered.out_info, compiled.output_shardings)
        return call


def _shape_name(args) -> str:
    """The leading array's shape, what tells the buckets apart (tokens or rows, the first
    argument after the weights and the KV pool)."""
    leaves = [x for x in jax.tree.leaves(args[2:3] or args) if hasattr(x, "shape")]
    return "x".join(str(d) for d in leaves[0].shape) if leaves else ""
