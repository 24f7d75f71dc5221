"""The vLLM paper's Fig. 15 (``study``: memory saved by sharing for parallel sampling and beam search,
with ``report``) and Fig. 14 (``serving``: capacity with request groups, with ``serving_report``), which
serves the beam trajectories Fig. 15's study records.
"""
