"""The vLLM paper's Fig. 19, swap against recompute: per-block costs by block size (``study``, from the cost
model and measured on the CPU engine) and end-to-end latency with each preemption mode on the simulator,
with ``report``."""
