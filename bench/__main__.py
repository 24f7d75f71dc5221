"""`python -m pagedbench.bench` (what `make bench` runs): every study with its default config, results to results/.

Each study is a module ``pagedbench.bench.<name>`` with ``main(argv: list[str]) -> None``.
``python -m pagedbench.bench STUDY [ARGS...]`` runs one study with its own arguments (e.g. ``calibrate
--quick``); ``python -m pagedbench.bench prepare-model smollm2`` prepares the real test model.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

STUDIES = ("costmodel.vidur_fit", "memory_study", "serving_study", "sim_speed", "calibrate", "calibrate_online",
           "host_cost", "kernel_study", "throughput_study", "engine_vs_hf", "batch_invariance",
           "load_speed", "beam_study", "beam_serving")
COMMANDS = {**{name: name for name in STUDIES}, "prepare-model": "prepare_model", "gpu-check": "gpu_check",
            "serve-sim": "serve_sim", "loadgen": "loadgen",
            "server_overhead": "server_overhead"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:  # one study or command, with its own arguments
        module = importlib.import_module(f"pagedbench.bench.{COMMANDS[argv[0]]}")
        return module.main(argv[1:]) or 0
    parser = argparse.ArgumentParser(prog="python -m pagedbench.bench", description=__doc__)
    parser.add_argument("--only", action="append", choices=STUDIES, help="run only this study (repeatable)")
    parser.add_argument("--full", action="store_true", help="the larger sweeps (configs' `full` sections)")
    args = parser.parse_args(argv)
    for name in args.only or STUDIES:
        print(f"\n=== bench: {name} ===", flush=True)
        start = time.perf_counter()
        module = importlib.import_module(f"pagedbench.bench.{name}")
        module.main(["--full"] if args.full else [])
        print(f"=== {name}: {time.perf_counter() - start:.1f} s ===", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
