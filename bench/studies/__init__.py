"""Each study in a folder of its own: its runner (``study``), config, report and plots together.

A study imports the core (``common``, ``workloads``, ``sim``, ``costmodel``) and never another study;
``python -m pagedbench.bench NAME`` runs one by its name (:mod:`pagedbench.bench.__main__`).
"""
