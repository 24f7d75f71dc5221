"""Old module paths of ``pagedbench.bench`` kept importable *and runnable* after its modules moved.

:class:`~pagedbench.refengine.module_aliases.MovedModuleFinder` makes ``import pkg.old`` give the module at
its new home (the same module object). ``python -m pkg.old`` needs more: :mod:`runpy` finds the old name's
spec and asks its loader for the code to run as ``__main__`` (``get_code``), without importing the module
first. :class:`RunnableMovedModuleFinder` answers with the new module's code and file, so a documented
command such as ``python -m pagedbench.bench.compile_check`` runs the module once, as ``__main__``, as it
did before the move.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Mapping

from pagedbench.refengine.module_aliases import MovedModuleFinder


class RunnableMovedModuleFinder(MovedModuleFinder):
    """A :class:`MovedModuleFinder` whose loader can also hand :mod:`runpy` the moved module's code."""

    def __init__(self, package: str, moved: Mapping[str, str]) -> None:
        super().__init__(package, moved)
        self._own_specs: dict = {}  # new module name -> its own spec, between create_module and exec_module

    def new_name(self, fullname: str) -> str:
        return f"{self.package}.{self.moved[fullname.rpartition('.')[2]]}"

    def _new_spec(self, fullname: str):
        spec = importlib.util.find_spec(self.new_name(fullname))
        if spec is None:  # a broken map: say which entry, not a bare ModuleNotFoundError from runpy
            raise ImportError(f"{fullname} moved to {self.new_name(fullname)}, which does not exist")
        return spec

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, old = fullname.rpartition(".")
        if prefix != self.package or old not in self.moved:
            return None
        # the new file as origin: runpy sets ``__file__`` from it (modules find their configs by it)
        return importlib.util.spec_from_loader(fullname, self, origin=self._new_spec(fullname).origin)

    def create_module(self, spec):
        module = super().create_module(spec)
        # the import system sets the module's __spec__ to the alias's next: exec_module puts its own back
        self._own_specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module) -> None:  # already executed under its new name
        module.__spec__ = self._own_specs.pop(module.__name__)

    def is_package(self, fullname: str) -> bool:
        return self._new_spec(fullname).submodule_search_locations is not None

    def get_code(self, fullname: str):
        spec = self._new_spec(fullname)
        return spec.loader.get_code(spec.name)

    def get_source(self, fullname: str):
        spec = self._new_spec(fullname)
        return spec.loader.get_source(spec.name)


def install(package: str, moved: Mapping[str, str]) -> None:
    """Put a :class:`RunnableMovedModuleFinder` for ``package``'s moved modules first on ``sys.meta_path``
    (once per package)."""
    if not any(isinstance(f, MovedModuleFinder) and f.package == package for f in sys.meta_path):
        sys.meta_path.insert(0, RunnableMovedModuleFinder(package, moved))
