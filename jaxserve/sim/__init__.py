"""The scheduling simulator: the real Scheduler, KVCacheManager and policies on a virtual clock,
timed by a step-cost model fitted to the real runner. Host only: never imports jax.

Imports config, request, core, the engine loop (jaxserve/engine/loop.py) and demo (the bundled
fit's model); never the runner or the model. Its command line and its calibration against the
real engine are jaxserve/tools (simulate.py, calibrate.py).
"""

from jaxserve.sim.cost_model import StepCostModel
from jaxserve.sim.metrics import RequestRecord, compute_metrics
from jaxserve.sim.simulator import SimResult, Simulator
from jaxserve.sim.workload import Burst, RequestSpec, read_trace, synthetic, write_trace

__all__ = ["Burst", "RequestRecord", "RequestSpec", "SimResult", "Simulator", "StepCostModel",
           "compute_metrics", "read_trace", "synthetic", "write_trace"]
