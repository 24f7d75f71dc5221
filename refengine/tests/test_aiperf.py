"""NVIDIA's ``aiperf`` load generator drives the server unchanged: a closed-loop run over the completions and
the chat endpoints, streamed, with every request answered (0 errors), the requested output lengths served,
and the KV pool empty afterwards.

aiperf pins its own dependencies, so it lives in a venv of its own (``make peers-aiperf``); the test finds
it there, on ``$PAGEDBENCH_AIPERF`` or on the PATH, and is skipped where it is absent. It is slow-marked:
aiperf starts a dozen worker processes, about ten seconds a run on two cores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from pagedbench.refengine import LLM
from pagedbench.refengine.server.launch import start_in_thread
from pagedbench.refengine.tests.test_stop_strings import words_folder  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow

REQUESTS, CONCURRENCY, OUTPUT_TOKENS = 24, 4, 8
# a pool that a full batch of CONCURRENCY requests overfills, so the run also queues and preempts
ENGINE = dict(seed=0, num_blocks=12, block_size=4)


def aiperf_binary() -> str | None:
    here = Path(__file__).resolve().parents[2] / ".peers-aiperf" / "bin" / "aiperf"
    for candidate in (os.environ.get("PAGEDBENCH_AIPERF"), str(here), shutil.which("aiperf")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def run_aiperf(url: str, folder: Path, endpoint: str, out: Path) -> dict:
    cmd = [aiperf_binary(), "profile", "--model", "words", "--url", url, "--endpoint-type", endpoint,
           "--tokenizer", str(folder), "--streaming", "--concurrency", str(CONCURRENCY),
           "--request-count", str(REQUESTS), "--synthetic-input-tokens-mean", "12",
           "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(OUTPUT_TOKENS),
           "--extra-inputs", "ignore_eos:true", "--ui-type", "none", "--artifact-dir", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads((out / "profile_export_aiperf.json").read_text())


@pytest.mark.skipif(aiperf_binary() is None, reason="aiperf is not installed (make peers-aiperf)")
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_aiperf_runs_without_an_error(words_folder, tmp_path, endpoint):  # noqa: F811
    llm = LLM(str(words_folder), **ENGINE)
    running = start_in_thread(llm, model_name="words", model_folder=str(words_folder))
    try:
        report = run_aiperf(running.url, words_folder, endpoint, tmp_path)
        used = llm.block_manager.num_used_blocks
    finally:
        running.stop()
    assert report["error_summary"] == [], report["error_summary"]
    assert report["request_count"]["avg"] == REQUESTS
    assert report["output_sequence_length"]["avg"] == OUTPUT_TOKENS
    assert report["output_sequence_length"]["min"] == OUTPUT_TOKENS
    assert used == 0
