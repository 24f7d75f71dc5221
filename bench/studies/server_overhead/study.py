"""What the HTTP server adds to the engine: per streamed token, and to the first token at low load.

``python -m pagedbench.bench server_overhead [--model M] [--batch 32] [--prompt-len 64] [--max-tokens 64]``

Three measurements in one run, on the same model and prompts:

1. **engine alone**: ``LLM.add_request`` x batch, then ``LLM.step()`` until done, each step timed; the
   decode step time is the median over the steps where every request decodes. A single request's
   first step (its prefill, which samples its first token) gives the engine's own time to first token.
2. **through the server**: the server (a separate process by default, as a deployment runs it; the
   client's parsing does not share its GIL) gets ``batch`` concurrent streaming requests with the same
   prompts; the client records each token's arrival. Inter-token latency (ITL) per stream is a decode
   step plus what the server spends turning the step's tokens into ``batch`` SSE events. The server's
   own step time during the run comes from its ``/metrics`` (``pagedbench:engine_step_seconds``).
   Then ``--ttft-requests`` single requests, one after another (low load): client TTFT.
3. the engine alone again (the machine's drift between 1 and 3 is the noise floor).

Overhead per streamed token = median client ITL - the server's own mean decode step over the same
steps (its ``/metrics`` read as the steady state opens and closes, so machine drift moves both alike);
its ratio to that step is the figure with the goal of 10% (SmolLM2 at batch 32 on the CPU). Beside it,
ITL against the engine's step alone, and the step inside the server over the step alone (what sharing
the process with the HTTP side costs the step). TTFT overhead = median client TTFT - median engine
prefill step. Writes ``results/server_overhead.{json,md}`` with the
machine's load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pagedbench.bench.common import environment as env_mod
from pagedbench.bench.common import records

SMOLLM2 = env_mod.REPO_ROOT / "models" / "SmolLM2-135M-Instruct"


def prompts(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """Distinct prompts (no shared prefix: the prefix cache must not shorten anyone's prefill)."""
    return [[(1 + i * 7919 + j * 104729) % (vocab - 1) + 1 for j in range(prompt_len)] for i in range(batch)]


def engine_alone(llm, ps: list[list[int]], max_tokens: int, salt: str) -> dict:
    """Decode step and single-request prefill step times of the engine with no server (seconds).
    ``salt``: a prefix-cache namespace of this pass, so that no pass finds another's prompts cached."""
    from pagedbench.refengine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for p in ps:
        llm.add_request({"prompt_token_ids": p, "cache_salt": salt}, params)
    times, batch = [], []
    while llm.scheduler.has_unfinished():
        n = len(llm.scheduler.running)
        start = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - start)
        batch.append((n, len(llm.scheduler.waiting)))
    # decode steps at full batch: every request was running before the step and none was waiting
    full = [t for t, (n, w) in zip(times, batch) if n == len(ps) and w == 0]
    prefill, one = [], SamplingParams(max_tokens=1, ignore_eos=True)
    for p in ps[:5]:
        llm.add_request({"prompt_token_ids": p[::-1], "cache_salt": salt}, one)
        start = time.perf_counter()
        while llm.scheduler.has_unfinished():
            llm.step()
        prefill.append(time.perf_counter() - start)
    return {"decode_step_ms": 1e3 * statistics.median(full), "num_decode_steps": len(full),
            "prefill_ms": 1e3 * statistics.median(prefill)}


async def _stream(client, url: str, prompt: list[int], max_tokens: int, on_first=None) -> tuple[float, list[float]]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    sent = time.perf_counter()
    times = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
                if len(times) == 1 and on_first is not None:
                    on_first()
    return sent, times


async def through_server(url: str, ps: list[list[int]], max_tokens: int, ttft_requests: int) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
        await _stream(client, url, ps[0][:4], 2)  # warm-up: first connection, first step

        async def scrape() -> tuple[float, float, float]:
            count, total = _step_metrics((await client.get(url + "/metrics")).text)
            return count, total, time.perf_counter()

        # the steady state opens when every stream has its first token (all admitted, all decoding):
        # the server's step counters are read then and after the last token, so the window's mean step
        # and the streams' token gaps are measured over the same steps, under the same machine load
        firsts, opened = [0], []

        def on_first() -> None:
            firsts[0] += 1
            if firsts[0] == len(ps):
                opened.append(asyncio.ensure_future(scrape()))

        runs = await asyncio.gather(*(_stream(client, url, p, max_tokens, on_first) for p in ps))
        start = await opened[0]
        end = await scrape()
        ttft = []
        for p in ps[:ttft_requests]:
            sent, times = await _stream(client, url, p[::-1], 1)  # reversed: not the batch's prompts
            ttft.append(times[0] - sent)
    # per stream, the mean gap over the window (its TPOT there): single gaps mean little when the
    # client reads a burst of events at once, a span does
    tpot = []
    for _, t in runs:
        tail = [x for x in t if x >= start[2]]
        if len(tail) > 1:
            tpot.append((tail[-1] - tail[0]) / (len(tail) - 1))
    steps = end[0] - start[0]
    if not tpot or not steps:
        raise RuntimeError("the steady state ended before the server's step counters were read: the steps are "
                           "too short for this measurement; raise --max-tokens")
    return {"itl_ms": 1e3 * statistics.median(tpot), "itl_max_ms": 1e3 * max(tpot), "num_streams": len(tpot),
            "server_step_ms": 1e3 * (end[1] - start[1]) / steps if steps else None,
            "server_steps": steps, "ttft_ms": 1e3 * statistics.median(ttft), "ttft_requests": len(ttft)}


def _step_metrics(text: str) -> tuple[float, float]:
    count = total = 0.0
    for line in text.splitlines():
        if line.startswith("pagedbench:engine_step_seconds_count"):
            count = float(line.rsplit(" ", 1)[1])
        elif line.startswith("pagedbench:engine_step_seconds_sum"):
            total = float(line.rsplit(" ", 1)[1])
    return count, total


def _start_process(model: str, port: int, max_num_seqs: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagedbench.refengine", "serve", "--model", model, "--port", str(port),
           "--max-num-seqs", str(max_num_seqs), "--log-level", "warning"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_healthy(url: str, proc: subprocess.Popen | None, timeout_s: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server at {url} was not healthy within {timeout_s} s")


def measure(model_spec: str, *, batch: int, prompt_len: int, max_tokens: int, ttft_requests: int,
            server: str) -> dict:
    from pagedbench.refengine import LLM
    from pagedbench.refengine.cli import resolve_model
    from pagedbench.refengine.server.launch import free_port, start_in_thread

    source = resolve_model(model_spec)
    load_before = os.getloadavg()
    llm = LLM(source, max_num_seqs=max(batch, 1))
    ps = prompts(batch, prompt_len, llm.config.vocab_size)
    first = engine_alone(llm, ps, max_tokens, "before")
    proc = running = None
    if server == "process":
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = _start_process(model_spec, port, max(batch, 1))
    else:
        running = start_in_thread(LLM(source, max_num_seqs=max(batch, 1)), model_name=model_spec)
        url = running.url
    try:
        _wait_healthy(url, proc)
        served = asyncio.run(through_server(url, ps, max_tokens, ttft_requests))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        if running is not None:
            running.stop()
    second = engine_alone(llm, ps, max_tokens, "after")
    step = statistics.fmean([first["decode_step_ms"], second["decode_step_ms"]])
    prefill = statistics.fmean([first["prefill_ms"], second["prefill_ms"]])
    inside = served["server_step_ms"]
    shown = Path(model_spec).name if Path(model_spec).is_dir() else model_spec  # no local path in results
    return {"model": shown, "batch": batch, "prompt_len": prompt_len, "max_tokens": max_tokens,
            "server": server, "engine_first": first, "engine_second": second, "served": served,
            "overhead_per_token_ms": served["itl_ms"] - inside,
            "overhead_ratio": (served["itl_ms"] - inside) / inside,
            "overhead_vs_alone_ms": served["itl_ms"] - step,
            "overhead_vs_alone_ratio": (served["itl_ms"] - step) / step,
            "step_inside_vs_alone": inside / step,
            "ttft_overhead_ms": served["ttft_ms"] - prefill,
            "engine_drift": abs(first["decode_step_ms"] - second["decode_step_ms"]) / step,
            "loadavg_before": load_before, "loadavg_after": os.getloadavg()}


def markdown(doc: dict) -> str:
    r, s = doc["result"], doc["result"]["served"]
    e1, e2 = r["engine_first"], r["engine_second"]
    step = (e1["decode_step_ms"] + e2["decode_step_ms"]) / 2
    rows = [
        ("decode step, engine alone (before / after)", f"{e1['decode_step_ms']:.2f} / {e2['decode_step_ms']:.2f} ms"),
        (f"decode step inside the server, steady state ({s['server_steps']:.0f} steps, /metrics)",
         f"{s['server_step_ms']:.2f} ms"),
        (f"ITL per stream through the server, same steps (median of {s['num_streams']} streams)",
         f"{s['itl_ms']:.2f} ms"),
        ("**server overhead per streamed token** (ITL - the server's own step, same window)",
         f"**{r['overhead_per_token_ms']:.2f} ms = {100 * r['overhead_ratio']:.1f}% of the step** (goal <= 10%)"),
        ("ITL - the engine's step alone (mean of before and after)",
         f"{r['overhead_vs_alone_ms']:.2f} ms = {100 * r['overhead_vs_alone_ratio']:.1f}%"),
        ("step inside the server / step alone", f"{r['step_inside_vs_alone']:.3f}"),
        ("prefill of one prompt, engine alone (median)", f"{(e1['prefill_ms'] + e2['prefill_ms']) / 2:.2f} ms"),
        (f"TTFT through the server, low load (median of {s['ttft_requests']})", f"{s['ttft_ms']:.2f} ms"),
        ("TTFT overhead", f"{r['ttft_overhead_ms']:.2f} ms"),
        ("engine drift between the two alone runs", f"{100 * r['engine_drift']:.1f}%"),
        ("load average (1 min) before / after", f"{r['loadavg_before'][0]:.2f} / {r['loadavg_after'][0]:.2f}"),
    ]
    table = "\n".join(f"| {a} | {b} |" for a, b in rows)
    return (f"# Server overhead\n\n{r['model']}, batch {r['batch']}, prompts of {r['prompt_len']} tokens, "
            f"{r['max_tokens']} output tokens each, server in a {r['server']}; decode steps at step "
            f"{step:.2f} ms.\n\n| measure | value |\n|---|---|\n{table}\n\n"
            "Method: `bench/studies/server_overhead/study.py` (engine alone, then the server, then the engine alone "
            "again, in one run). ITL includes the step. The headline overhead is ITL minus the server's own "
            "decode step over the same steps (read from its /metrics as the steady state opens and closes), "
            "so the machine's drift moves both alike; the step inside the server against the engine alone "
            "(before and after, a drift apart) shows what sharing a process with the HTTP side costs the "
            "step itself. The client runs on the same machine and competes for its cores.\n\n"
            + env_mod.environment_markdown(doc["environment"]))


def _ms(v) -> str:
    return "-" if v is None else f"{v:.2f} ms"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedbench.bench server_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(SMOLLM2) if SMOLLM2.is_dir() else "small",
                   help="model folder or named config (default: SmolLM2 when prepared, else small)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ttft-requests", type=int, default=8)
    p.add_argument("--server", choices=("process", "thread"), default="process")
    p.add_argument("--out", default=str(env_mod.RESULTS_DIR), help="output folder (default: results/)")
    p.add_argument("--full", action="store_true", help="(no larger sweep; accepted for make bench)")
    args = p.parse_args(argv)
    for name in ("batch", "prompt_len", "max_tokens", "ttft_requests"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_tokens < 8:
        p.error("--max-tokens must be >= 8 (the steady state needs a few decode steps)")
    result = measure(args.model, batch=args.batch, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                     ttft_requests=args.ttft_requests, server=args.server)
    doc = {"schema_version": records.SCHEMA_VERSION, "environment": env_mod.environment(), "result": result}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records.write_json(out / "server_overhead.json", doc)
    records.write_text(out / "server_overhead.md", markdown(doc))
    print(markdown(doc))
    print(json.dumps({k: result[k] for k in ("overhead_per_token_ms", "overhead_ratio", "overhead_vs_alone_ratio",
                                              "step_inside_vs_alone", "ttft_overhead_ms")}))
    return 0
