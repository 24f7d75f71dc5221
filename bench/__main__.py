"""`python -m pagedbench.bench` (what `make bench` runs): every study with its default config, results to results/.

Each study is a module (``STUDY_MODULES``: most are ``pagedbench.bench.studies.<study>.study``) with
``main(argv: list[str]) -> None``.
After the studies it writes ``results/README.md`` (``bench/headline.py``), the page of headline answers.
``python -m pagedbench.bench STUDY [ARGS...]`` runs one study with its own arguments (e.g. ``calibrate
--quick``); ``python -m pagedbench.bench prepare-model smollm2`` prepares the real test model.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

from pagedbench.bench.common import run_times
from pagedbench.bench.common.environment import RESULTS_DIR

#: each study by the name ``--only`` and ``python -m pagedbench.bench NAME`` know it -> its module
STUDY_MODULES = {
    "costmodel.vidur_fit": "costmodel.vidur_fit", "memory_study": "studies.memory.study",
    "serving_study": "studies.serving.study", "sim_speed": "studies.sim_speed.study",
    "calibrate": "studies.calibrate.study", "calibrate_online": "studies.calibrate.online",
    "host_cost": "studies.host_cost.study", "kernel_study": "studies.kernels.study",
    "throughput_study": "studies.throughput.study", "engine_vs_hf": "studies.engine_vs_hf.study",
    "batch_invariance": "studies.batch_invariance.study", "load_speed": "studies.load_speed.study",
    "beam_study": "studies.beam.study", "beam_serving": "studies.beam.serving",
    "engine_vs_vllm": "studies.engine_vs_vllm",
    "engine_vs_vllm_profile": "studies.engine_vs_vllm.profile_study", "costmodel.fit_error": "costmodel.fit_error",
    "fig19": "studies.fig19.study", "shared_prefix": "studies.shared_prefix.study",
    "chatbot": "studies.chatbot.study", "multi_turn": "studies.multi_turn.study",
    "batch_gap": "studies.batch_gap.study",
}
STUDIES = tuple(STUDY_MODULES)
COMMANDS = {**STUDY_MODULES, "prepare-model": "prepare_model", "gpu-check": "gpu_check",
            "serve-sim": "studies.serve_sim.study", "loadgen": "loadgen",
            "server_overhead": "studies.server_overhead.study", "headline": "headline"}


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:  # one study or command, with its own arguments
        module = importlib.import_module(f"pagedbench.bench.{COMMANDS[argv[0]]}")
        status = module.main(argv[1:])
        # a study's main may return its record (vidur_fit does): only an int is an exit status
        return status if isinstance(status, int) else 0
    parser = argparse.ArgumentParser(prog="python -m pagedbench.bench", description=__doc__)
    parser.add_argument("--only", action="append", choices=STUDIES, help="run only this study (repeatable)")
    parser.add_argument("--full", action="store_true", help="the larger sweeps (configs' `full` sections)")
    args = parser.parse_args(argv)
    times: dict[str, float] = {}
    loads = [_load_average()]
    for name in args.only or STUDIES:
        print(f"\n=== bench: {name} ===", flush=True)
        start = time.perf_counter()
        module = importlib.import_module(f"pagedbench.bench.{STUDY_MODULES[name]}")
        module.main(["--full"] if args.full else [])
        times[name] = time.perf_counter() - start
        loads.append(_load_average())
        print(f"=== {name}: {times[name]:.1f} s ===", flush=True)
    if not args.only:  # a whole run: how long make bench (or bench-full) took, study by study
        run_times.write(RESULTS_DIR, "bench-full" if args.full else "bench", times, loads)
    # the one-screen page, from whatever records the studies (this run's and earlier ones) left
    importlib.import_module("pagedbench.bench.headline").main([])
    return 0


if __name__ == "__main__":
    sys.exit(main())
