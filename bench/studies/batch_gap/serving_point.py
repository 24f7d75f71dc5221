"""The serving study's Fig. 2/13 point, read from its config file (``bench/configs/serving.yaml``).

A study never imports another (bench/tests/test_layout.py), so this reads the serving study's *data*,
not its loader: the config's first setting (the paper's), the dataset's memory point (rate, scheduler
policy), the paged allocator's block size and the method's knobs, resolved by the same rules (a dataset's
span over its setting's over the top-level one; a dataset's ``max_seq_len`` over its setting's over the
model's context). bench/tests/test_batch_gap.py checks that every value equals what the serving study's
own loader reads from the same file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml
from pagedbench.bench.costmodel import load_model
from pagedbench.bench.sim.settings import Dataset, Setting


class ServingPointError(ValueError):
    """The serving config lacks what the decomposition needs: names the file and the missing piece."""


@dataclass(frozen=True, slots=True)
class ServingPoint:
    setting: Setting
    dataset: Dataset
    rate: float  # the memory point's offered rate (req/s)
    policy: str  # the memory point's scheduler policy
    block_size: int  # the paged allocator's
    max_num_seqs: int
    max_num_batched_tokens: int
    watermark: float
    gpu_memory_utilization: float
    span_s: float
    warmup_frac: float
    cooldown_frac: float
    overload_z: float
    max_seq_len: int


def read_serving_point(path: str | Path, dataset: str = "sharegpt") -> ServingPoint:
    """The serving config's memory point for ``dataset`` on its first setting (module docstring)."""
    path = Path(path)
    doc = yaml.safe_load(path.read_text())
    try:
        # the serving loader's rule: a study-wide linear_model unless the setting names its own
        setting = Setting(**{"linear_model": doc.get("linear_model", "roofline"), **doc["settings"][0]})
        d = next((d for d in doc["datasets"] if d["name"] == dataset), None)
        m = next((m for m in doc["memory_points"] if m["dataset"] == dataset), None)
        paged = next((a for a in doc["allocators"] if a["kind"] == "paged"), None)
        if d is None or m is None or paged is None:
            raise ServingPointError(f"{path}: needs a dataset, a memory point and a paged allocator for "
                                    f"{dataset!r} (dataset: {d is not None}, memory point: {m is not None}, "
                                    f"paged allocator: {paged is not None})")
        data = Dataset(**{**d, **{k: tuple(d[k]) for k in ("settings", "kinds", "policies") if d.get(k)}})
        span = data.span_s or setting.span_s or doc["span_s"]
        msl = data.max_seq_len or setting.max_seq_len or load_model(setting.model).max_position_embeddings
        return ServingPoint(setting, data, float(m["rate"]), m.get("policy", "separate"), int(paged["block_size"]),
                            int(doc["max_num_seqs"]), int(doc["max_num_batched_tokens"]), float(doc["watermark"]),
                            float(doc["gpu_memory_utilization"]), float(span), float(doc["warmup_frac"]),
                            float(doc["cooldown_frac"]), float(doc["overload_z"]), int(msl))
    except (KeyError, TypeError, IndexError) as e:
        raise ServingPointError(f"{path}: cannot read the serving point: {e!r}") from None
