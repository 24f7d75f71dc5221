"""Every implementation the gate can run, by name: ours, the mutation check's, and whatever a ``--load``ed
module registered with :func:`conformance.adapter.register`.

This module imports the built-in implementations (so they register); nothing it imports imports it back,
so the adapter interface, the implementations and the mutants form no circle. Importing it imports no
kernel and no Triton: ours import ``kernels`` only when built.
"""

from __future__ import annotations

# Imported for their registrations: ours, PyTorch's FlexAttention, and the mutation check's.
from pagedbench.conformance import batched_torch_adapter, flex_adapter, implementations  # noqa: F401
from pagedbench.conformance.adapter import _REGISTRY, Implementation
from pagedbench.conformance.mutation import layout_mutants, mutants  # noqa: F401

__all__ = ["available", "expected_to_pass", "get", "listed", "mutant_names"]


def available() -> list[str]:
    """Every registered name, the mutation check's included."""
    return sorted(_REGISTRY)


def listed() -> list[str]:
    """The names offered to a user: every registered one but the mutation check's own."""
    return sorted(n for n, factory in _REGISTRY.items() if getattr(factory, "listed", True))


def mutant_names() -> list[str]:
    """The mutation check's deliberately broken implementations."""
    return [n for n in available() if n.startswith("mutant-")]


def expected_to_pass(name: str) -> bool:
    """Whether ``name`` is expected to pass, read without building it (building ours imports kernels)."""
    return bool(getattr(_REGISTRY[name], "expected_to_pass", True))


def get(name: str) -> Implementation:
    """A fresh instance of the implementation registered as ``name``."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown implementation {name!r}; known: {', '.join(listed())}") from None
    impl = factory()
    impl.name = name
    return impl
