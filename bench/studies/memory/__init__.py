"""The memory accounting across block sizes and placements, and what parallel sampling saves
(``study``, ``report``, ``plots``).
"""
