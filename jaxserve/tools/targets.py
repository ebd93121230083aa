"""The accelerators users serve on, described for XLA to compile for without them.

    h100, h200, a100, l4      one NVIDIA GPU a process (tp of them: "h100" with -tp 8 is a node)
    v5e-N, v6e-N, v5p-N       a TPU slice of N chips

Each chip's numbers (memory, bandwidth, peak bf16 matmul, and for the GPUs the device
description XLA's GPU compiler reads) are the vendors' published figures, in targets.json beside
this file. `target_devices` makes compile-only devices for a target: with libtpu installed
(the `aot-tpu` extra) a TPU topology, with the CUDA plugin and ptxas (`aot-gpu`) a GPU one. They
compile, never run; this machine's backend stays the CPU.
"""

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

SPECS = json.loads((Path(__file__).resolve().parent / "targets.json").read_text())


@dataclass(frozen=True)
class Target:
    name: str  # as the user wrote it: h100, v5e-8
    chip: str  # the key in targets.json
    platform: str  # gpu | tpu
    count: int  # chips a TPU slice has; 0 for a GPU (as many as tensor_parallel_size needs)
    memory_bytes: int  # per chip
    bandwidth: float  # bytes/s from memory, per chip
    peak_flops: float  # bf16 matmul, per chip
    device_kind: str

    @property
    def spec(self) -> dict:
        return SPECS[self.chip]

    @property
    def usable_bytes(self) -> int:
        """What a process has of a chip's memory: on a GPU, JAX's client preallocates 75% of it
        by default (XLA_PYTHON_CLIENT_MEM_FRACTION), the runner's bytes_limit; on a TPU, its
        HBM."""
        return int(self.memory_bytes * (0.75 if self.platform == "gpu" else 1.0))


def parse_target(name: str) -> Target:
    """"h100", "v5e-8", ...; a ValueError naming the choices otherwise."""
    match = re.fullmatch(r"([a-z0-9]+?)(?:-(\d+))?", name.strip().lower())
    chip = match and match.group(1)
    if not match or chip not in SPECS:
        raise ValueError(f"target {name!r}: expected one of {choices()}")
    spec = SPECS[chip]
    count = int(match.group(2) or 0)
    if spec["platform"] == "tpu":
        if str(count) not in spec["slices"]:
            raise ValueError(f"target {name!r}: a {chip} slice of "
                             f"{' | '.join(str(n) for n in spec['slices'])} chips "
                             f"(e.g. {chip}-{list(spec['slices'])[-1]})")
    elif count:
        raise ValueError(f"target {name!r}: a GPU target is one GPU ({chip}); give -tp for "
                         "several")
    return Target(name, chip, spec["platform"], count, int(spec["memory_bytes"]),
                  float(spec["bandwidth"]), float(spec["peak_bf16_flops"]), spec["device_kind"])


def choices() -> str:
    gpus = [c for c, s in SPECS.items() if s["platform"] == "gpu"]
    tpus = [f"{c}-N (N in {'/'.join(map(str, s['slices']))})" for c, s in SPECS.items()
            if s["platform"] == "tpu"]
    return ", ".join(gpus + tpus)


def _gpu_target_config(spec: dict) -> str:
    """The GpuTargetConfigProto (text form) XLA's GPU compiler reads a device's description
    from: the fields it needs to compile, with this chip's numbers."""
    d = spec["gpu"]
    major, minor = d["compute_capability"]
    return f"""gpu_device_info {{
  name: "{spec['device_kind']}"
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  core_count: {d['core_count']}
  fpus_per_core: {d['fpus_per_core']}
  threads_per_warp: 32
  threads_per_block_limit: 1024
  threads_per_core_limit: 2048
  shared_memory_per_block: 49152
  shared_memory_per_core: {d['shared_memory_per_core']}
  shared_memory_per_block_optin: {d['shared_memory_per_block_optin']}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  clock_rate_ghz: {d['clock_rate_ghz']}
  memory_bandwidth: {int(spec['bandwidth'])}
  l2_cache_size: {d['l2_cache_size']}
  device_memory_size: {int(spec['memory_bytes'])}
}}
platform_name: "CUDA"
device_description_str: "{spec['device_kind']}"
"""


def target_devices(target: Target, count: int) -> list:
    """`count` compile-only devices of the target (a TPU slice: all its chips, count <= them).
    A ValueError saying what to install where the compiler for it is missing."""
    from jax.experimental import topologies

    if target.platform == "tpu":
        try:
            import libtpu  # noqa: F401  (the TPU compiler)
        except ImportError as error:
            raise ValueError(f"compiling for {target.name} needs libtpu: pip install "
                             "'jaxserve[aot-tpu]'") from error
        # libtpu takes a machine-wide lock when it loads, for the chips it drives; topologies
        # drive none, so a compile here must not wait on (or block) a process that has them
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        if count > target.count:
            raise ValueError(f"tensor_parallel_size {count}: {target.name} has {target.count} "
                             "chips")
        shape, per_host = SPECS[target.chip]["slices"][str(target.count)]
        topology = topologies.get_topology_desc(
            platform="tpu", topology_name=f"{target.chip}:{shape}", chip_config_name="default",
            chips_per_host_bounds=tuple(per_host), num_slices=1)
        return list(topology.devices)[:count]
    if os.environ.get("JAX_PLATFORMS", "").lower() != "cpu":
        # the CUDA plugin registers its compiler only when it is not asked for a GPU
        import jax

        jax.config.update("jax_platforms", "cpu")
    try:
        topology = topologies.get_topology_desc(
            target.chip, platform="cuda", target_config=_gpu_target_config(target.spec),
            topology=f"1x1x{count}")
    except (NotImplementedError, RuntimeError) as error:
        raise ValueError(f"compiling for {target.name} needs the CUDA plugin and ptxas: pip "
                         f"install 'jaxserve[aot-gpu]' ({error})") from error
    return list(topology.devices)
