"""GPU profiles (``bench/configs/hardware/<name>.yaml``): datasheet roofs and how much of them is reached.

The roofs (bandwidth, dense FLOP/s, memory) are datasheet figures; the achievable fractions and the
overheads are measured (:mod:`pagedbench.bench.costmodel.vidur_fit` fits them on A100 linear-layer profiles);
the price is a user-editable assumption used only for cost-per-token figures; ``all_reduce_network`` names
the node type whose measured all-reduces price tensor parallelism (:mod:`pagedbench.bench.costmodel.all_reduce`);
the host link (bandwidth and per-transfer latency) prices copies to and from host memory
(:mod:`pagedbench.bench.costmodel.host_link`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pagedbench.bench.costmodel.all_reduce_extract import NETWORKS
from pagedbench.bench.costmodel.profile_fields import (
    FieldSpec,
    fraction,
    non_negative,
    one_of,
    positive,
    profile_path,
    read_profile,
)

HARDWARE_DIR = Path(__file__).resolve().parent.parent / "configs" / "hardware"


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """One GPU, as the step-cost roofline sees it."""

    name: str
    memory_bytes: int  # device memory (HBM)
    hbm_bandwidth_bytes_per_s: float  # datasheet peak
    dense_flops_per_s: float  # datasheet dense fp16/bf16 tensor-core peak (no sparsity)
    dtype: str  # the dtype dense_flops_per_s is quoted for
    bandwidth_fraction: float  # share of the peak bandwidth a weight-streaming GEMM reaches
    compute_fraction: float  # share of the peak FLOP/s a large GEMM reaches
    layer_overhead_s: float  # fixed cost per transformer layer (kernel launches, tails)
    step_overhead_s: float  # fixed cost per serving step (scheduling, sampling, launch)
    price_per_gpu_hour_usd: float  # an assumption, see the YAML comment
    # the node type whose measured all-reduces price tensor parallelism (a row set of
    # bench/data/vidur/all_reduce.csv); None: not measured, tensor_parallel_size > 1 is refused
    all_reduce_network: str | None = None
    # the host link (bench.costmodel.host_link prices swaps and host-tier loads over it): its name,
    # one direction's achievable bandwidth and the fixed cost of one transfer
    host_link: str = "pcie_gen4_x16"
    host_link_bandwidth_bytes_per_s: float = 25e9
    host_link_latency_s: float = 5e-6

    @property
    def achievable_bandwidth_bytes_per_s(self) -> float:
        return self.hbm_bandwidth_bytes_per_s * self.bandwidth_fraction

    @property
    def achievable_flops_per_s(self) -> float:
        return self.dense_flops_per_s * self.compute_fraction


_SPECS = {
    "name": FieldSpec(str),
    "memory_bytes": positive(int),
    "hbm_bandwidth_bytes_per_s": positive(float),
    "dense_flops_per_s": positive(float),
    "dtype": one_of("float16", "bfloat16"),
    "bandwidth_fraction": fraction(),
    "compute_fraction": fraction(),
    "layer_overhead_s": non_negative(float),
    "step_overhead_s": non_negative(float),
    "price_per_gpu_hour_usd": non_negative(float),
    "all_reduce_network": one_of(*NETWORKS, "none"),
    "host_link": one_of("pcie_gen4_x16", "pcie_gen5_x16"),
    "host_link_bandwidth_bytes_per_s": positive(float),
    "host_link_latency_s": non_negative(float),
}


def load_hardware(name: str, directory: Path = HARDWARE_DIR) -> HardwareProfile:
    """The profile ``directory/<name>.yaml``; :class:`ProfileError` if unknown or invalid."""
    path = profile_path(directory, name)
    read = read_profile(path, _SPECS)
    fields = read.values
    if fields["name"] != name:
        # A copied file whose name was not updated would silently report the wrong GPU.
        raise read.error(path, "name", f"expected {name!r} (the file name), got {fields['name']!r}")
    network = fields.pop("all_reduce_network")
    return HardwareProfile(**fields, all_reduce_network=None if network == "none" else network)


def hardware_names(directory: Path = HARDWARE_DIR) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.yaml"))
