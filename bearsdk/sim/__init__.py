"""Evaluation harness: the real router against simulated engines, in virtual time.

* :class:`SimEngine`: one instance's engine loop (the policy spec's scheduler,
  the emulator's ground-truth batch times and output lengths) in virtual time.
* :func:`run_scenario`: one policy routing one workload through
  :class:`~bearsdk.router.AsyncRouter` on a virtual clock (or the oracles).
* :func:`load_config` / :func:`run_config`: ``bearsdk simulate`` configurations,
  sweeps run in parallel, :func:`summarize` for the paper's headline numbers.
* :func:`write_plots`: the paper's figures (the ``plot`` extra).

See ``docs/simulation.md``.
"""

from bearsdk.sim.calibrate import Calibration, calibrate_pool
from bearsdk.sim.config import (
    BASELINES,
    PAPER_POOL,
    POLICIES,
    SimConfig,
    SimConfigError,
    SweepSpec,
    WorkloadSpec,
    load_config,
    parse_config,
)
from bearsdk.sim.engine import BatchNoise, EngineEvent, SimEngine, bind_engine
from bearsdk.sim.inputs import SimInputError, build_requests, engine_output_lengths
from bearsdk.sim.plots import PlotError, write_plots
from bearsdk.sim.run import run_scenario
from bearsdk.sim.scenario import (
    ORACLE,
    ORACLE_LATENCY,
    InstanceSpec,
    PolicySpec,
    RequestSet,
    RunResult,
    Scenario,
    arrival_times,
)
from bearsdk.sim.sweep import Inputs, Progress, SimReport, prepare_inputs, run_config, summarize

__all__ = [
    "BASELINES",
    "ORACLE",
    "ORACLE_LATENCY",
    "PAPER_POOL",
    "POLICIES",
    "BatchNoise",
    "Calibration",
    "EngineEvent",
    "Inputs",
    "InstanceSpec",
    "PlotError",
    "PolicySpec",
    "Progress",
    "RequestSet",
    "RunResult",
    "Scenario",
    "SimConfig",
    "SimConfigError",
    "SimEngine",
    "SimInputError",
    "SimReport",
    "SweepSpec",
    "WorkloadSpec",
    "arrival_times",
    "bind_engine",
    "build_requests",
    "calibrate_pool",
    "engine_output_lengths",
    "load_config",
    "parse_config",
    "prepare_inputs",
    "run_config",
    "run_scenario",
    "summarize",
    "write_plots",
]
