"""How fast the simulator runs (``study``), against the simulator of an earlier commit timed in the
same run (``baseline``).
"""
