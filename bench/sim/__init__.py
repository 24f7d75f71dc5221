"""The serving simulator, below every study: the real scheduler and KV managers serving a request trace on
a simulated clock, with step times from a constant or the cost model.

- ``simulator``: :func:`simulate` (the entry point) and :func:`constant_step`; ``run``: one run's state,
  its measured window and overload test; ``accounting``: where each step's KV memory goes; ``records``:
  the inputs and results (:class:`SimConfig`, :class:`AllocatorSpec`, :class:`SimResult`).
- ``fast_forward``, ``decode_session``, ``run_clock``, ``admission``: runs of decode steps served in one go
  with the same schedule as step by step.
- ``follow_ups``: requests released by another's completion plus a think time (a conversation's turns).
- ``group_replay``: parallel samples and replayed beam searches as request groups; ``sharing``: the memory
  sharing saves a group on the block manager alone.
- ``settings``, ``points``, ``serving_search``, ``capacity_search``: the serving method over the simulator
  (a setting and a dataset, one point at one rate, a point's capacities searched, their intervals), which
  the serving studies share; ``paired_capacity``: several KV managers' capacities on the same arrivals and
  their paired ratios (the paper's throughput figures).

Imports no study.
"""
