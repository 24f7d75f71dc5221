"""``python -m pagedbench.bench.costmodel [--model NAME]``: KV slots and a few step times for every GPU profile.

A quick look at what the step-cost model says (prints only; nothing is written).
"""

from __future__ import annotations

import argparse

from pagedbench.bench.costmodel.hardware import hardware_names, load_hardware
from pagedbench.bench.costmodel.kv_slots import kv_slot_budget
from pagedbench.bench.costmodel.models import load_model, model_names
from pagedbench.bench.costmodel.step_cost import StepBatch, StepCostModel
from tabulate import tabulate

#: label -> batch: decode at batch 1 and 64 (context 1024), a 2048-token prompt, a mixed chunked step
EXAMPLE_BATCHES = {
    "decode x1 @1024": StepBatch.of((1024,)),
    "decode x64 @1024": StepBatch.of((1024,) * 64),
    "prefill 2048": StepBatch.of(prefill_chunks=((2048, 0),)),
    "64 decode + chunk 512@1536": StepBatch.of((1024,) * 64, ((512, 1536),)),
}


def report(model_name: str) -> list[str]:
    model = load_model(model_name)
    lines = [*kv_slot_budget(model, load_hardware("a100-40gb")).lines(), ""]
    rows = []
    for gpu_name in hardware_names():
        gpu = load_hardware(gpu_name)
        cost = StepCostModel.from_profiles(model, gpu)
        rows.append([gpu_name, f"{kv_slot_budget(model, gpu).num_slots:,}",
                     *(f"{cost.step_time_s(b) * 1e3:.2f}" for b in EXAMPLE_BATCHES.values())])
    lines.append(f"Step time (ms) of {model_name}:")
    lines += tabulate(rows, headers=["gpu", "KV slots", *EXAMPLE_BATCHES], tablefmt="github").splitlines()
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pagedbench.bench.costmodel", description=__doc__)
    parser.add_argument("--model", default="opt-13b", choices=model_names())
    args = parser.parse_args(argv)
    print("\n".join(report(args.model)))


if __name__ == "__main__":
    main()
