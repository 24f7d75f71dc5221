"""Paged vs contiguous decode time and bandwidth on a GPU (``study``), and the decode sweep over
batch and context (``decode_sweep``) that the GPU check runs.
"""
