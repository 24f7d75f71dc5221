"""The engine's whole host step and the peers' block managers, timed side by side in one run.

Every implementation runs :mod:`bench.studies.host_cost.peer_worker` in a process of its own (vLLM's wheel pins
another torch, so it lives in the ``make peers`` venv; nano-vllm is a checkout given by path), on the
same trace. Rounds are interleaved (round 1 of every implementation, then round 2...), so a machine
that slows down slows all of them alike; each figure is the best round. Only ratios measured this way
are published: a peer that cannot run here gets a line saying why, never a figure from elsewhere.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

WORKER = Path(__file__).resolve().parent / "peer_worker.py"
OURS = "pagedbench"
PEERS = ("nano-vllm", "vllm-v1")
NANO_VLLM_ENV = "PAGEDBENCH_NANO_VLLM"
PEERS_VENV_ENV = "PAGEDBENCH_PEERS_VENV"
DEFAULT_PEERS_VENV = Path(".peers")
MEASUREMENT_NAMES = {
    "kv": "KV manager, per decode token (as its scheduler calls it)",
    "append": "`append_token` alone, per decode token",
    "scheduler": "scheduler decode step without a model, per sequence",
    "engine": "engine step with a stub model, per sequence (scheduler, block manager, metadata, sampling)",
    "engine_cpu_layout": "the same, with the CPU attention backend's padded layout built per step",
}


@dataclass(frozen=True, slots=True)
class WorkerCommand:
    """How to start one implementation's worker, or why it cannot start (``python`` None)."""

    name: str
    python: str | None
    reason: str | None = None  # why it is absent (python None)


def locate(nano_vllm: str | None, peers_venv: str | Path | None) -> list[WorkerCommand]:
    """Ours first, then each peer: its interpreter, or why it is not installed."""
    venv = Path(peers_venv) if peers_venv else DEFAULT_PEERS_VENV
    venv_python = venv / "bin" / "python"
    commands = [WorkerCommand(OURS, sys.executable)]
    if nano_vllm is None:
        commands.append(WorkerCommand("nano-vllm", None, f"no checkout given (--nano-vllm PATH or {NANO_VLLM_ENV})"))
    elif not (Path(nano_vllm) / "nanovllm" / "engine" / "block_manager.py").is_file():
        commands.append(WorkerCommand("nano-vllm", None, f"{nano_vllm} is not a nano-vllm checkout"))
    else:  # pure Python + xxhash: the peers venv has xxhash; our own interpreter may not
        commands.append(WorkerCommand("nano-vllm", str(venv_python) if venv_python.exists() else sys.executable))
    if venv_python.exists():
        commands.append(WorkerCommand("vllm-v1", str(venv_python)))
    else:
        commands.append(WorkerCommand("vllm-v1", None, f"no peers venv at {venv} (run `make peers`)"))
    return commands


class _Worker:
    def __init__(self, command: WorkerCommand, trace: dict) -> None:
        self.name = command.name
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115  (closed by close())
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([command.python, str(WORKER), command.name], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env)
        self.proc.stdin.write(json.dumps(trace) + "\n")
        self.proc.stdin.flush()

    def answer(self) -> dict:
        for line in self.proc.stdout:  # a peer may log to stdout; the protocol's lines are JSON objects
            if line.startswith("{"):
                return json.loads(line)
        self.stderr.seek(0)
        tail = self.stderr.read()[-500:].strip()
        raise RuntimeError(f"{self.name}: the worker exited (code {self.proc.wait()}): {tail}")

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        self.stderr.close()


def run_side_by_side(commands: list[WorkerCommand], trace: dict, rounds: int) -> dict[str, dict]:
    """name -> {"status": "ok", "seconds": {measurement: [one per round]}} or {"status": "not installed",
    "reason": ...}; rounds interleaved across the implementations."""
    results: dict[str, dict] = {}
    workers = []
    try:
        for c in commands:
            if c.python is None:
                results[c.name] = {"status": "not installed", "reason": c.reason}
                continue
            w = _Worker(c, trace)
            ready = w.answer()
            if not ready.get("ready"):
                results[c.name] = {"status": "not installed", "reason": ready.get("reason")}
                w.close()
                continue
            workers.append(w)
            results[c.name] = {"status": "ok", "seconds": {m: [] for m in ready["measurements"]}}
        for _ in range(rounds):
            for w in workers:
                w.proc.stdin.write("round\n")
                w.proc.stdin.flush()
                for m, s in w.answer()["seconds"].items():
                    results[w.name]["seconds"][m].append(s)
    finally:
        for w in workers:
            w.close()
    return results


def summarise(results: dict[str, dict], num_seq_steps: int) -> dict[str, dict]:
    """Per implementation and measurement: µs per sequence-step (best round), and peer / ours."""
    ours = results.get(OURS, {}).get("seconds", {})
    out = {}
    for name, r in results.items():
        if r["status"] != "ok":
            out[name] = {"status": r["status"], "reason": r["reason"]}
            continue
        figures = {}
        for m, rounds in r["seconds"].items():
            us = min(rounds) / num_seq_steps * 1e6
            ref = min(ours[m]) / num_seq_steps * 1e6 if ours.get(m) else None
            figures[m] = {"us_per_seq_step": us, "us_per_seq_step_rounds": [s / num_seq_steps * 1e6 for s in rounds],
                          "ratio_to_ours": us / ref if ref else None}
        out[name] = {"status": "ok", "figures": figures}
    return out


def engine_verdict(engine_us: float | None, append_us: float, limit: float,
                   per_round: tuple[list[float], list[float]] | None = None) -> dict:
    """The engine's host time per sequence per decode step against ``limit`` x append_token's cost.

    ``per_round``: both timed in each of the same rounds; the ratio is then the median of the rounds'
    ratios, each taken between neighbours in time (a ratio of the best rounds can pair a fast moment of
    one with a slow moment of the other on a machine whose speed drifts)."""
    if engine_us is None or not math.isfinite(append_us) or append_us <= 0:
        return {"engine_us_per_seq_step": engine_us, "append_token_us": append_us, "ratio": None,
                "limit": limit, "verdict": "not measured"}
    ratio = engine_us / append_us
    if per_round is not None:
        ratio = statistics.median(e / a for e, a in zip(*per_round))
    return {"engine_us_per_seq_step": engine_us, "append_token_us": append_us, "ratio": ratio, "limit": limit,
            "verdict": "met" if ratio <= limit else "not met"}


def markdown(summary: dict[str, dict], verdict: dict, trace_note: str, rounds: int) -> list[str]:
    measurements = [m for m in MEASUREMENT_NAMES if any(
        m in s.get("figures", {}) for s in summary.values())]
    head = "| implementation | " + " | ".join(f"{MEASUREMENT_NAMES[m]}: µs (÷ ours)" for m in measurements)
    lines = [
        "## The engine's whole host step, and the peers side by side", "",
        f"{trace_note}. Each implementation runs in a process of its own (`bench/studies/host_cost/peer_worker.py`), "
        f"rounds interleaved, best of {rounds}; admission is untimed.", "",
        head + " |", "|---" * (len(measurements) + 1) + "|",
    ]
    for name, s in summary.items():
        if s["status"] != "ok":
            continue
        cells = []
        for m in measurements:
            f = s["figures"].get(m)
            if f is None:
                cells.append("not driven")
            else:
                ratio = "" if f["ratio_to_ours"] is None else f" ({f['ratio_to_ours']:.2f}x)"
                cells.append(f"{f['us_per_seq_step']:.2f}{ratio}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    for name, s in summary.items():
        if s["status"] != "ok":
            lines.append(f"- {name}: {s['status']} ({s['reason']})")
    lines += ["", "vLLM v1 is driven through its `KVCacheManager` only (its `Scheduler` needs a full "
              "`VllmConfig`); nano-vllm's block manager and scheduler are its own code, imported from the "
              "checkout without its GPU model runner.", ""]
    if verdict["ratio"] is None:
        lines.append("Engine host overhead per sequence per decode step: not measured.")
    else:
        lines.append(
            f"Engine host overhead per sequence per decode step: {verdict['engine_us_per_seq_step']:.2f} µs = "
            f"**{verdict['ratio']:.2f}x** the block manager's `append_token` ({verdict['append_token_us']:.2f} µs, "
            f"timed in the same rounds; the median of the rounds' ratios); "
            f"goal ≤ {verdict['limit']:g}x: **{verdict['verdict']}**.")
    ours = summary.get(OURS, {}).get("figures", {})
    layout, engine = ours.get("engine_cpu_layout"), ours.get("engine")
    if layout and engine:
        lines += ["", f"The CPU attention backend (`torch-batched`, the engine's default on a CPU) adds its padded "
                  f"layout to every step: {layout['us_per_seq_step']:.2f} µs per sequence with it, "
                  f"{layout['us_per_seq_step'] / engine['us_per_seq_step']:.1f}x the step without it. It pads "
                  "each decode to the next power of two of its length (at most twice its keys); the verdict "
                  "above is on the step every backend shares (a GPU backend builds no such layout)."]
    return lines
