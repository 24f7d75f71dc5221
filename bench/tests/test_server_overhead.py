"""The server-overhead study on the tiny model (server on a thread, a few tokens): the engine-alone and
served figures are measured and the overhead is their difference, written as JSON and Markdown."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from pagedbench.bench.studies.server_overhead import study as server_overhead


def test_study_writes_its_figures(tmp_path, monkeypatch):
    # tiny's steps take about a millisecond: slowed to 10 ms, so that the steady-state window outlasts
    # the client's read of the server's counters on a loaded machine
    from pagedbench.refengine.engine.model_executor import ModelExecutor

    execute = ModelExecutor.execute

    def slow(self, out):
        time.sleep(0.01)
        return execute(self, out)

    monkeypatch.setattr(ModelExecutor, "execute", slow)
    assert server_overhead.main(["--model", "tiny", "--batch", "3", "--prompt-len", "5", "--max-tokens", "16",
                                 "--ttft-requests", "2", "--server", "thread", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "server_overhead.json").read_text())["result"]
    step = (r["engine_first"]["decode_step_ms"] + r["engine_second"]["decode_step_ms"]) / 2
    assert r["engine_first"]["num_decode_steps"] >= 5 and r["served"]["num_streams"] == 3
    inside = r["served"]["server_step_ms"]
    assert r["overhead_per_token_ms"] == pytest.approx(r["served"]["itl_ms"] - inside)
    assert r["overhead_ratio"] == pytest.approx(r["overhead_per_token_ms"] / inside)
    assert r["overhead_vs_alone_ms"] == pytest.approx(r["served"]["itl_ms"] - step)
    # the window holds only steady-state decode steps: fewer than the 8 tokens' steps, at least one
    assert 1 <= r["served"]["server_steps"] <= 15 and r["served"]["ttft_ms"] > 0
    assert r["engine_first"]["decode_step_ms"] >= 10 and r["served"]["server_step_ms"] >= 10
    assert "server overhead per streamed token" in (tmp_path / "server_overhead.md").read_text()
