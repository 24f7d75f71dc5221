"""Our launchers by name, imported on first use: ``LAUNCHERS["triton"]`` is ``pagedbench.kernels``,
``LAUNCHERS["torch"]`` is ``pagedbench.kernels.reference``.

The suite's checks of our own launchers' messages use this, so that importing a suite module imports no
kernel (and no Triton) when the gate runs another project's implementation.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from types import ModuleType

_MODULES = {"triton": "pagedbench.kernels", "torch": "pagedbench.kernels.reference"}


class _LazyLaunchers(Mapping[str, ModuleType]):
    def __getitem__(self, name: str) -> ModuleType:
        return importlib.import_module(_MODULES[name])

    def __iter__(self) -> Iterator[str]:
        return iter(_MODULES)

    def __len__(self) -> int:
        return len(_MODULES)


LAUNCHERS: Mapping[str, ModuleType] = _LazyLaunchers()
