"""The simulator of an earlier commit timed on the same trace, in this run: what "N times faster than the
simulator was" means when the machine's speed drifts 2x between runs.

:func:`time_commit` extracts the commit's ``refengine``, ``kernels``, ``conformance`` and ``bench`` folders
(``git archive``) into a temporary folder laid out as the ``pagedbench`` package, and times one step-by-step
simulation there in a subprocess that imports that copy (put first on its path; the module's file is
checked, so a run that imported the installed package instead fails rather than timing it). Its trace is
built by the commit's own ``workloads.synthetic`` with the same arguments; the caller compares the generated
tokens and steps with its own run, so a changed trace or schedule is seen rather than timed.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from pagedbench.bench.common import environment as env_mod

#: the simulator when the fast-forward's goal (10x its simulated tokens per wall second) was set: the commit
#: whose results/sim_speed.md published the figure it was set against
GOAL_BASELINE = "e5c09c8"
PARTS = ("refengine", "kernels", "conformance", "bench")

_SCRIPT = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from pagedbench.bench import workloads, serving_sim
if not serving_sim.__file__.startswith(sys.argv[1]):
    raise SystemExit(f"imported {serving_sim.__file__}, not the copy under {sys.argv[1]}")
args = json.loads(sys.argv[2])
trace = workloads.synthetic("sharegpt", args["num_requests"], rate=args["rate"], seed=0)
cfg = serving_sim.SimConfig(kv_slots=args["kv_slots"], step_s=0.08, policy="mixed")
spec = serving_sim.AllocatorSpec("paged", args["block_size"])
walls, cpus = [], []
for _ in range(args.get("repeats", 1)):
    wall, cpu = time.perf_counter(), time.process_time()
    result = serving_sim.simulate(trace, spec, cfg, account=False)
    walls.append(time.perf_counter() - wall)
    cpus.append(time.process_time() - cpu)
    out = {"generated_tokens": result.num_generated_tokens, "num_steps": result.num_steps,
           "simulated_s": result.simulated_s}
    del result  # (each run starts with no result alive, as the runs compared with it: see sim_speed._timed)
print(json.dumps({"wall_s": min(walls), "cpu_s": min(cpus), "walls_s": walls, **out}))
"""


def _extract(commit: str, dest: Path) -> None:
    tar = subprocess.run(["git", "-C", str(env_mod.REPO_ROOT), "archive", "--format=tar", commit, *PARTS],
                         capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(dest / "pagedbench", filter="data")


def time_commit(commit: str, *, num_requests: int, rate: float, block_size: int, kv_slots: int,
                repeats: int = 1, timeout_s: float = 600.0) -> dict:
    """``repeats`` step-by-step simulations by ``commit``'s simulator, one after another in one process:
    ``{"commit", "wall_s", "cpu_s", "walls_s", "generated_tokens", "num_steps", "simulated_s"}`` (the fastest
    run's wall and CPU seconds, and every run's wall seconds); or ``{"commit", "unavailable": why}`` when the
    commit cannot be read (a shallow clone) or its run fails."""
    if type(repeats) is not int or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    try:
        full = subprocess.run(["git", "-C", str(env_mod.REPO_ROOT), "rev-parse", "--verify", f"{commit}^{{commit}}"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        return {"commit": commit, "unavailable": f"commit {commit} not found in this clone ({e})"}
    args = {"num_requests": num_requests, "rate": rate, "block_size": block_size, "kv_slots": kv_slots,
            "repeats": repeats}
    with tempfile.TemporaryDirectory(prefix="sim-baseline-") as tmp:
        root = Path(tmp)
        try:
            _extract(full, root)
        except (OSError, subprocess.CalledProcessError, tarfile.TarError) as e:
            return {"commit": full[:12], "unavailable": f"could not extract {commit}: {e}"}
        env = {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1"}
        run = subprocess.run([sys.executable, "-c", _SCRIPT, str(root), json.dumps(args)], capture_output=True,
                             text=True, env=env, cwd=tmp, timeout=timeout_s)
    if run.returncode != 0:
        return {"commit": full[:12], "unavailable": f"its simulation failed: {run.stderr.strip()[-400:]}"}
    return {"commit": full[:12], **json.loads(run.stdout.strip().splitlines()[-1])}
