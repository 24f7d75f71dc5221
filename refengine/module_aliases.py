"""Old module paths kept importable after a move: ``import pkg.old`` gives the module at its new home.

A package that moved modules installs one :class:`MovedModuleFinder` with its old-name -> new-path map;
the old name then imports *the same module object* as the new one, so module state and classes are
shared (an ``isinstance`` check agrees whichever path a caller used).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Mapping


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``<package>.<old>`` as ``<package>.<moved[old]>``."""

    def __init__(self, package: str, moved: Mapping[str, str]) -> None:
        self.package, self.moved = package, dict(moved)

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, old = fullname.rpartition(".")
        if prefix != self.package or old not in self.moved:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(f"{self.package}.{self.moved[spec.name.rpartition('.')[2]]}")

    def exec_module(self, module) -> None:  # already executed under its new name
        pass


def install(package: str, moved: Mapping[str, str]) -> None:
    """Put a finder for ``package``'s moved modules first on ``sys.meta_path`` (once per package)."""
    if not any(isinstance(f, MovedModuleFinder) and f.package == package for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder(package, moved))
