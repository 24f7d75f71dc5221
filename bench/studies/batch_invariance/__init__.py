"""What ``batch_invariant=True`` costs: the engine's wall time against the default mode's (``study``)."""
