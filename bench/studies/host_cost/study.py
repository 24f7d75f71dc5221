"""The host-cost study: what the block manager itself costs per operation.

``python -m pagedbench.bench --only host_cost`` (or ``main([])``) runs the default config
(``bench/configs/host_cost.yaml``; ``--full`` the longer runs). ShareGPT-like prompts
(:func:`bench.workloads.synthetic`, random token ids) are admitted ``batch`` at a time into a
``refengine.BlockManager`` with block size 16, prefix caching on or off, with or without a shared
512-token system prompt. pytest-benchmark (:mod:`bench.studies.host_cost.benchmarks`, run in-process through
``pytest.main``) times, with set-up outside the timed region:

* ``admission``: ``allocate`` of every prompt into a fresh manager            -> µs per admission
* ``decode``: ``decode_steps`` steps of one ``append_token`` per sequence at the peak batch
                                                          -> µs per decode token; x batch = µs per step
* ``step``: the same steps with ``can_append`` and ``slot`` of the new token, as a scheduler and the
  engine's slot mapping need them                              -> µs per scheduler step (full work)
* ``free``: ``free`` of every sequence after the decode steps            -> µs per free

Each variant is first run once untimed with ``check_invariants`` and a leak check (correctness before
timing). Then :mod:`bench.studies.host_cost.peers` times, on the ``peer_variant``'s trace, the engine's whole host
step (a stub in place of the model) and nano-vllm's and vLLM v1's block managers where present, each in
a worker process, rounds interleaved: ratios to ours, and the engine's host time per sequence-step
against the ``append_token`` cost measured above (``--nano-vllm PATH``, ``--peers-venv DIR``).
The target is at most 2 µs per decode token appended with prefix caching on: the report
gives measured / target and a verdict, and never fails. Writes ``results/host_cost.json`` (records
with the environment) and ``results/host_cost.md`` (tables), and prints the tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from pagedbench.bench import workloads
from pagedbench.bench.common import environment as env_mod
from pagedbench.bench.common import records as result_files
from pagedbench.bench.studies.host_cost import peers as host_cost_peers
from tabulate import tabulate

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "host_cost.yaml"
BENCH_FILE = Path(__file__).resolve().parent / "benchmarks.py"
VOCAB = 32000  # token ids are drawn from [0, VOCAB)
MAX_REL_IQR = 0.5  # a measurement noisier than this (interquartile range / median) is marked invalid
# A machine slowed down uniformly (another job, thermal or frequency limits) does not widen the IQR: a
# fixed reference loop timed before and after the benchmarks shows it, and so does a load average above
# the core count.
MAX_REFERENCE_DRIFT = 0.25
REFERENCE_ITERATIONS = 200_000


def reference_loop_s(repeats: int = 5) -> float:
    """Best-of-``repeats`` seconds of a fixed pure-Python loop: this machine's speed right now."""
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        total = 0
        for i in range(REFERENCE_ITERATIONS):
            total += i & 7
        best = min(best, time.perf_counter() - start)
    return best


def machine_speed_reasons(ref_start_s: float, ref_end_s: float, load_start: float, cpu_count: int) -> list[str]:
    """Why the machine's speed makes every figure of this run suspect ([] when it held steady)."""
    reasons = []
    drift = abs(ref_end_s / ref_start_s - 1)
    if drift > MAX_REFERENCE_DRIFT:
        reasons.append(f"machine speed changed during the run: the reference loop took {ref_start_s * 1e3:.1f} ms "
                       f"before and {ref_end_s * 1e3:.1f} ms after ({drift:.0%})")
    if load_start > cpu_count:
        reasons.append(f"machine busy: load average {load_start:.1f} on {cpu_count} cores")
    return reasons
MEASUREMENTS = {  # name -> (unit, what one round covers)
    "admission": ("admission", "allocate every prompt into a fresh manager"),
    "decode": ("decode token", "decode_steps x batch append_token calls"),
    "step": ("scheduler step", "decode_steps steps of can_append + append_token + slot per sequence"),
    "free": ("free", "free every sequence after the decode steps"),
}


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    prefix_caching: bool
    system_prompt: bool


@dataclass(frozen=True, slots=True)
class HostCostConfig:
    dataset: str
    batch: int
    block_size: int
    decode_steps: int
    system_prompt_len: int
    seed: int
    rounds: int
    target_us_per_token: float
    variants: tuple[Variant, ...]
    peer_variant: str  # the variant whose trace every implementation serves side by side
    peer_rounds: int  # interleaved rounds of the side-by-side comparison
    engine_host_limit: float  # the engine's host time per sequence-step, at most this x append_token


#: the config the benchmark module reads (set by :func:`main`; None: the default YAML)
ACTIVE: HostCostConfig | None = None


def load_config(path: str | Path = CONFIG, *, full: bool = False) -> HostCostConfig:
    raw = yaml.safe_load(Path(path).read_text())
    overrides = raw.pop("full", {}) or {}
    if full:
        raw.update(overrides)
    known = {f.name for f in dataclasses.fields(HostCostConfig)}
    if set(raw) - known or known - set(raw):
        raise ValueError(f"{path}: unknown keys {sorted(set(raw) - known)}, "
                         f"missing keys {sorted(known - set(raw))}")
    raw["variants"] = tuple(Variant(**v) for v in raw["variants"])
    return HostCostConfig(**raw)


def active_config() -> HostCostConfig:
    return ACTIVE if ACTIVE is not None else load_config()


@dataclass(frozen=True, slots=True)
class Workload:
    """Token ids for one variant: prompts [batch][len], decode tokens [decode_steps][batch]."""

    prompts: tuple[list[int], ...]
    decode_tokens: tuple[list[int], ...]
    num_blocks: int  # a pool that never runs out in this workload, even without sharing


def build_workload(cfg: HostCostConfig, variant: Variant) -> Workload:
    trace = workloads.synthetic(cfg.dataset, cfg.batch, seed=cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    system = rng.integers(0, VOCAB, cfg.system_prompt_len).tolist() if variant.system_prompt else []
    prompts = tuple(system + rng.integers(0, VOCAB, r.prompt_len).tolist() for r in trace)
    decode = tuple(rng.integers(0, VOCAB, cfg.batch).tolist() for _ in range(cfg.decode_steps))
    bs = cfg.block_size
    num_blocks = sum(math.ceil((len(p) + cfg.decode_steps) / bs) for p in prompts) + 1
    return Workload(prompts, decode, num_blocks)


def check_correctness(cfg: HostCostConfig, variant: Variant, w: Workload) -> dict:
    """One untimed episode: admit, decode, check the invariants, free, check nothing leaked."""
    from pagedbench.refengine import BlockManager

    bm = BlockManager(w.num_blocks, cfg.block_size, enable_prefix_caching=variant.prefix_caching)
    for i, p in enumerate(w.prompts):
        bm.allocate(i, p)
    for step_tokens in w.decode_tokens:
        for i, t in enumerate(step_tokens):
            bm.append_token(i, t)
    bm.check_invariants()
    m = bm.metrics()
    for i in range(len(w.prompts)):
        bm.free(i)
    bm.check_invariants()
    leaked = bm.num_used_blocks
    reasons = [f"{leaked} blocks still used after freeing every sequence"] if leaked else []
    if variant.prefix_caching and variant.system_prompt:
        expected = (len(w.prompts) - 1) * (cfg.system_prompt_len // cfg.block_size * cfg.block_size)
        if m.prefix_hit_tokens < expected:
            reasons.append(f"prefix hits {m.prefix_hit_tokens} tokens < {expected} the system prompt gives")
    return {"checked": True, "ok": not reasons, "reasons": reasons, "prefix_hit_tokens": m.prefix_hit_tokens,
            "prefix_query_tokens": m.prefix_query_tokens, "peak_used_blocks": m.used_blocks,
            "internal_fragmentation_slots": m.internal_fragmentation_slots}


def run_benchmarks(cfg: HostCostConfig) -> list[dict]:
    """pytest-benchmark over :mod:`bench.studies.host_cost.benchmarks`; its JSON benchmarks, one per measurement."""
    import pytest

    global ACTIVE
    ACTIVE = cfg
    sys.modules.pop("pagedbench.bench.studies.host_cost.benchmarks", None)  # it reads ACTIVE when imported
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "benchmarks.json"
            rc = pytest.main([str(BENCH_FILE), "-q", "-p", "no:cacheprovider", "-o", "python_files=*.py",
                              f"--benchmark-json={out}", "--benchmark-columns=min,median,stddev,rounds",
                              "--benchmark-sort=name"])
            if rc != 0:
                raise RuntimeError(f"host-cost benchmarks failed (pytest exit code {int(rc)})")
            return json.loads(out.read_text())["benchmarks"]
    finally:
        ACTIVE = None


def records(cfg: HostCostConfig, benchmarks: list[dict], correctness: dict[str, dict]) -> list[dict]:
    by_name = {v.name: v for v in cfg.variants}
    out = []
    for b in benchmarks:
        info = b["extra_info"]
        st = b["stats"]
        units = info["units_per_round"]
        reasons = []
        if st["rounds"] < 3:
            reasons.append(f"only {st['rounds']} rounds")
        if st["median"] > 0 and st["iqr"] / st["median"] > MAX_REL_IQR:
            reasons.append(f"noisy: interquartile range {st['iqr'] / st['median']:.0%} of the median")
        if not correctness[info["variant"]]["ok"]:
            reasons.append("the correctness check failed")
        out.append({
            "variant": dataclasses.asdict(by_name[info["variant"]]),
            "measurement": info["measurement"],
            "unit": MEASUREMENTS[info["measurement"]][0],
            "units_per_round": units,
            "batch": cfg.batch,
            "seconds_per_round": {k: st[k] for k in ("min", "median", "mean", "stddev", "iqr", "rounds")},
            "us_per_unit": {"median": st["median"] / units * 1e6, "min": st["min"] / units * 1e6},
            "correctness": correctness[info["variant"]],
            "validity": {"valid": not reasons, "reasons": reasons},
        })
    return sorted(out, key=lambda r: ([v.name for v in cfg.variants].index(r["variant"]["name"]),
                                      list(MEASUREMENTS).index(r["measurement"])))


def verdicts(cfg: HostCostConfig, recs: list[dict]) -> list[dict]:
    """Measured / target per decode token for every variant with prefix caching on (no assertion)."""
    out = []
    for r in recs:
        if r["measurement"] == "decode" and r["variant"]["prefix_caching"]:
            us = r["us_per_unit"]["median"]
            ratio = us / cfg.target_us_per_token
            out.append({"variant": r["variant"]["name"], "us_per_decode_token": us,
                        "us_per_decode_token_min": r["us_per_unit"]["min"], "valid": r["validity"]["valid"],
                        "target_us": cfg.target_us_per_token, "ratio": ratio,
                        "verdict": "meets the target" if ratio <= 1 else "misses the target"})
    return out


def side_by_side_lines(doc: dict) -> list[str]:
    cfg, sbs = doc["config"], doc["side_by_side"]
    note = (f"The `{sbs['variant']}` variant's trace: {cfg['batch']} {cfg['dataset']}-like prompts admitted at "
            f"once, then {cfg['decode_steps']} decode steps of every sequence, block size {cfg['block_size']}")
    return host_cost_peers.markdown(sbs["summary"], sbs["engine_verdict"], note, cfg["peer_rounds"])


def markdown(doc: dict) -> str:
    """The report: cost per operation for every variant, the target verdicts."""
    cfg, recs, load = doc["config"], doc["records"], doc["machine_load"]
    cell = {(r["variant"]["name"], r["measurement"]): r for r in recs}

    def us(name: str, m: str, scale: float = 1.0) -> str:
        r = cell.get((name, m))
        if r is None:
            return "-"
        mark = "" if r["validity"]["valid"] else " (invalid)"
        return f"{r['us_per_unit']['median'] * scale:,.2f}{mark}"

    rows = []
    for v in cfg["variants"]:
        n = v["name"]
        c = cell.get((n, "decode"), {}).get("correctness", {})
        rate = c["prefix_hit_tokens"] / c["prefix_query_tokens"] if c.get("prefix_query_tokens") else None
        rows.append([n, "on" if v["prefix_caching"] else "off", "yes" if v["system_prompt"] else "no",
                     us(n, "admission"), us(n, "decode"), us(n, "decode", cfg["batch"]), us(n, "step"),
                     us(n, "free"), "-" if rate is None else f"{rate:.1%}"])
    head = ["variant", "prefix cache", f"{cfg['system_prompt_len']}-token system prompt", "µs / admission",
            "µs / decode token", f"µs / step (append x {cfg['batch']})", "µs / step (+ can_append, slot)",
            "µs / free", "prefix hit rate"]
    target = [[t["variant"], f"{t['us_per_decode_token']:.3f}", f"{t['us_per_decode_token_min']:.3f}",
               f"{t['target_us']:.1f}", f"{t['ratio']:.2f}",
               t["verdict"] + ("" if t["valid"] else " (noisy)")]
              for t in doc["target"]]
    invalid = [f"- {r['variant']['name']} / {r['measurement']}: {'; '.join(r['validity']['reasons'])}"
               for r in recs if not r["validity"]["valid"]]
    return "\n".join([
        "# Host cost of the block manager", "",
        f"{cfg['dataset']}-like prompts (`bench.workloads.synthetic`, seed {cfg['seed']}), "
        f"batch {cfg['batch']} admitted at once, block size {cfg['block_size']}, "
        f"{cfg['decode_steps']} decode steps per round at the peak batch; median of {cfg['rounds']} "
        "pytest-benchmark rounds (set-up untimed, garbage collector on). A step is one "
        "`append_token` per running sequence; the last step column adds `can_append` and `slot` of the new "
        "token. Each variant was checked once (invariants, no leak) before timing.", "",
        tabulate(rows, head, tablefmt="github"), "",
        f"## Target: at most {cfg['target_us_per_token']:g} µs per decode token appended, "
        "prefix caching on", "",
        tabulate(target, ["variant", "µs / decode token (median)", "(min)", "target µs",
                          "median / target", "verdict"],
                 tablefmt="github"), "",
        *side_by_side_lines(doc), "",
        *(["Invalid measurements:", *invalid, ""] if invalid else []),
        "Machine load while timing (1-minute load average, start / end): "
        f"{load['load_average_1m_start']:.1f} / {load['load_average_1m_end']:.1f} on "
        f"{doc['environment']['machine']['cpu_count']} cores; "
        "other processes inflate and scatter these figures.", "",
        env_mod.environment_markdown(doc["environment"]),
    ])


def peer_trace(cfg: HostCostConfig, nano_vllm: str | None) -> dict:
    """The side-by-side comparison's input: the peer variant's workload, as the workers read it."""
    variant = next((v for v in cfg.variants if v.name == cfg.peer_variant), None)
    if variant is None:
        raise ValueError(f"peer_variant {cfg.peer_variant!r} is not one of the variants "
                         f"{[v.name for v in cfg.variants]}")
    w = build_workload(cfg, variant)
    return {"prompts": list(w.prompts), "decode_tokens": list(w.decode_tokens), "block_size": cfg.block_size,
            "num_blocks": w.num_blocks + cfg.batch, "prefix_caching": variant.prefix_caching,
            "nano_vllm_path": nano_vllm}


def side_by_side(cfg: HostCostConfig, recs: list[dict], nano_vllm: str | None, peers_venv: str | None) -> dict:
    """Every implementation on the peer variant's trace, interleaved, and the engine's verdict against the
    ``append_token`` cost measured in the same rounds (the pytest-benchmark median, minutes away on a
    machine whose speed drifts, only when the worker did not time it)."""
    trace = peer_trace(cfg, nano_vllm)
    commands = host_cost_peers.locate(nano_vllm, peers_venv)
    results = host_cost_peers.run_side_by_side(commands, trace, cfg.peer_rounds)
    summary = host_cost_peers.summarise(results, cfg.batch * cfg.decode_steps)
    ours = summary.get(host_cost_peers.OURS, {}).get("figures", {})
    engine, append = ours.get("engine", {}), ours.get("append", {})
    if engine and append:  # each round's engine against the same round's append_token, then the median
        verdict = host_cost_peers.engine_verdict(
            engine["us_per_seq_step"], append["us_per_seq_step"], cfg.engine_host_limit,
            per_round=(engine["us_per_seq_step_rounds"], append["us_per_seq_step_rounds"]))
    else:
        median = next((r["us_per_unit"]["median"] for r in recs
                       if r["measurement"] == "decode" and r["variant"]["name"] == cfg.peer_variant), math.nan)
        verdict = host_cost_peers.engine_verdict(engine.get("us_per_seq_step"), median, cfg.engine_host_limit)
    return {"variant": cfg.peer_variant, "results": results, "summary": summary, "engine_verdict": verdict}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m pagedbench.bench host_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="the config's `full` section")
    parser.add_argument("--config", default=str(CONFIG), help="YAML config (default: %(default)s)")
    parser.add_argument("--out", default=str(env_mod.RESULTS_DIR), help="output folder (default: results/)")
    parser.add_argument("--nano-vllm", default=os.environ.get(host_cost_peers.NANO_VLLM_ENV),
                        help=f"a nano-vllm checkout to compare with (default: ${host_cost_peers.NANO_VLLM_ENV})")
    parser.add_argument("--peers-venv", default=os.environ.get(host_cost_peers.PEERS_VENV_ENV),
                        help="the `make peers` venv, with vLLM (default: .peers)")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, full=args.full)
    correctness = {v.name: check_correctness(cfg, v, build_workload(cfg, v)) for v in cfg.variants}
    load_start = os.getloadavg()[0]
    ref_start = reference_loop_s()
    recs = records(cfg, run_benchmarks(cfg), correctness)
    peers = side_by_side(cfg, recs, args.nano_vllm, args.peers_venv)
    ref_end = reference_loop_s()
    machine = machine_speed_reasons(ref_start, ref_end, load_start, os.cpu_count() or 1)
    for r in recs:
        if machine:
            r["validity"] = {"valid": False, "reasons": r["validity"]["reasons"] + machine}
    doc = {"environment": env_mod.environment(), "config": dataclasses.asdict(cfg), "records": recs,
           "target": verdicts(cfg, recs), "side_by_side": peers,
           "machine_load": {"load_average_1m_start": load_start, "load_average_1m_end": os.getloadavg()[0],
                            "reference_loop_s_start": ref_start, "reference_loop_s_end": ref_end}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result_files.write_json(out / "host_cost.json", doc)
    text = markdown(doc)
    result_files.write_text(out / "host_cost.md", text)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
