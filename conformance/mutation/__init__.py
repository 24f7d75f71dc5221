"""Proof that the suite fails: deliberately broken implementations it must catch (``mutants``, run by
``make test``), and the mutation check of our real source (``check``: ``make mutants``), with its
operators, runner, equivalences and report.
"""
