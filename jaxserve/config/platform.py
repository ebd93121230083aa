"""Which of jax's platforms a process asks for when JAX_PLATFORMS is unset: the CPU alone on a
machine with no accelerator's device files.

The test and compile extras install the CUDA plugin and libtpu (to compile for GPUs and TPUs
without one, tools/targets.py). Where no GPU or TPU is attached, jax's backend discovery
still starts both, and each prints an error with a traceback ("Unable to load CUDA", "could
not determine TPU worker hostnames") before falling back to the CPU: on every command. A
machine with an NVIDIA driver (/proc/driver/nvidia, /dev/nvidiactl) or TPU chips (/dev/accel*,
/dev/vfio/<n>, or TPU_ACCELERATOR_TYPE set) keeps jax's own choice. Host only: no jax here.
"""

import os
import sys
from pathlib import Path


def has_accelerator() -> bool:
    if Path("/proc/driver/nvidia").exists() or Path("/dev/nvidiactl").exists():
        return True
    if os.environ.get("TPU_ACCELERATOR_TYPE") or any(Path("/dev").glob("accel*")):
        return True
    vfio = Path("/dev/vfio")
    return vfio.is_dir() and any(p.name.isdigit() for p in vfio.iterdir())


def default_to_cpu() -> None:
    """JAX_PLATFORMS=cpu where it is unset and no accelerator is attached (jax reads it when
    it is imported; where jax was imported already, its config instead)."""
    if "JAX_PLATFORMS" in os.environ or has_accelerator():
        return
    if "jax" in sys.modules:
        jax = sys.modules["jax"]
        if not jax.config.jax_platforms:
            jax.config.update("jax_platforms", "cpu")
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
