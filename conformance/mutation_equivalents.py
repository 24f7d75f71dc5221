"""Mutants of the real source that no test can kill because they change nothing observable, each with
the reason. Keyed by (file, function, operator, mutated text), so the entry survives line moves.

A surviving mutant that is *not* here is a gap in the tests: the mutation check fails on it.
"""

from __future__ import annotations

from pagedbench.conformance.mutation_operators import Mutant

EQUIVALENT: dict[tuple[str, str, str, str], str] = {}


def key_of(mutant: Mutant) -> tuple[str, str, str, str]:
    return (mutant.path, mutant.function, mutant.operator, " ".join(mutant.mutated.split()))


def equivalence_reason(mutant: Mutant) -> str | None:
    return EQUIVALENT.get(key_of(mutant))
