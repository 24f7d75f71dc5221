"""``python -m pagedbench.bench serve-sim``: one trace served on the simulator over a sweep of rates
(``study``, ``report``).
"""
