"""`python -m pagedbench.bench` (what `make bench` runs): every study with its default config, results to results/.

Each study is a module ``bench.<name>`` with ``main(argv: list[str]) -> None``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

STUDIES = ("memory_study", "serving_study", "sim_speed", "host_cost", "kernel_study", "throughput_study")


def main(argv: list[str] | None = None) -> int:
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
