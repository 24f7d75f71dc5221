"""PagedBench's benchmark harness: the studies behind ``make bench`` (``python -m pagedbench.bench``).

- ``common/``: what every study shares: result records, the environment record, progress, step timing,
  serving metrics, SLOs, the sweep runner.
- ``workloads/``: requests and their length distributions, trace formats, arrivals, spans of a trace.
- ``sim/``: the serving simulator (the real scheduler and KV managers on a simulated clock) and the method
  of a serving point (settings, points, capacity searches).
- ``costmodel/``: the step-cost model of a GPU and its calibration.
- ``studies/<study>/``: each study's runner, config and report together. Studies import the core above;
  the core imports no study, and no study imports another.
- ``gpu_check``, ``compare``, ``prepare_model``, ``loadgen``: the commands that are not studies.

The flat module paths of earlier versions (``pagedbench.bench.serving_sim``, ``.records``...) still import,
and those that ran still run (``python -m pagedbench.bench.compile_check``): they are aliases of the modules'
new homes (:mod:`pagedbench.bench.module_aliases`).
"""

from __future__ import annotations

from pagedbench.bench.module_aliases import install

#: module paths of the flat layout -> where each module lives now
MOVED_MODULES = {
    "environment": "common.environment", "records": "common.records", "progress": "common.progress",
    "step_timing": "common.step_timing", "serving_metrics": "common.serving_metrics", "slo": "common.slo",
    "sweep_runner": "common.sweep_runner",
    "arrivals": "workloads.arrivals", "trace_formats": "workloads.trace_formats",
    "trace_spans": "workloads.trace_spans",
    "serving_sim": "sim.simulator", "sim_admission": "sim.admission", "sim_decode_session": "sim.decode_session",
    "sim_fast_forward": "sim.fast_forward", "sim_records": "sim.records", "sim_run_clock": "sim.run_clock",
    "group_replay": "sim.group_replay", "capacity_search": "sim.capacity_search", "serving_points": "sim.points",
    "serving_config": "studies.serving.config", "serving_study": "studies.serving.study",
    "serving_report": "studies.serving.report", "serving_plots": "studies.serving.plots",
    "serving_precision": "studies.serving.precision",
    "memory_study": "studies.memory.study", "memory_report": "studies.memory.report",
    "memory_plots": "studies.memory.plots",
    "beam_study": "studies.beam.study", "beam_report": "studies.beam.report", "beam_serving": "studies.beam.serving",
    "beam_serving_report": "studies.beam.serving_report",
    "calibrate": "studies.calibrate.study", "calibrate_config": "studies.calibrate.config",
    "calibrate_report": "studies.calibrate.report", "calibrate_steps": "studies.calibrate.steps",
    "calibrate_validation": "studies.calibrate.validation", "calibrate_online": "studies.calibrate.online",
    "online_compare": "studies.calibrate.online_compare", "online_report": "studies.calibrate.online_report",
    "throughput_study": "studies.throughput.study", "throughput_report": "studies.throughput.report",
    "engine_vs_hf": "studies.engine_vs_hf.study", "engine_vs_hf_report": "studies.engine_vs_hf.report",
    "batch_invariance": "studies.batch_invariance.study",
    "load_speed": "studies.load_speed.study",
    "host_cost": "studies.host_cost.study", "host_cost_bench": "studies.host_cost.benchmarks",
    "host_cost_peers": "studies.host_cost.peers", "host_cost_worker": "studies.host_cost.peer_worker",
    "kernel_study": "studies.kernels.study", "decode_sweep": "studies.kernels.decode_sweep",
    "sim_speed": "studies.sim_speed.study", "sim_baseline": "studies.sim_speed.baseline",
    "serve_sim": "studies.serve_sim.study", "serve_sim_report": "studies.serve_sim.report",
    "server_overhead": "studies.server_overhead.study",
    "compile_check": "studies.compile_check.study",
}

install(__name__, MOVED_MODULES)
