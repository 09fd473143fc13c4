"""Old names of renamed packages, kept working for a release.

The programs' packages were top-level names any project may use (``train``, ``eval``,
``projector``); they are now ``moonvit_train``, ``moonvit_eval`` and ``moonvit_projector``. Each
old name is a package of one ``__init__.py`` that calls :func:`alias_package`: importing it warns
once (``FutureWarning``, shown by default) and gives the new package itself, and every module below
it (``train.config``) is the new one's module object (``moonvit_train.config``), never a second copy,
so classes, ``isinstance`` checks, pickles and monkeypatches agree whichever name is used.
``python -m train`` and ``python -m eval.linear_probe`` run the new modules' code as ``__main__``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import CodeType, ModuleType

__all__ = ["alias_package"]


class _AliasLoader(importlib.abc.Loader):
    """Loads ``old.x`` as the module ``new.x`` already is (importing it first)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing: the module ran when it was imported under its own name."""

    def get_code(self, fullname: str) -> CodeType | None:
        """The new module's code, for ``python -m old.x`` (runpy runs it as ``__main__``)."""
        spec = importlib.util.find_spec(self.target)
        loader = None if spec is None else spec.loader
        get_code = getattr(loader, "get_code", None)
        return None if get_code is None else get_code(self.target)


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``old.x`` as ``new.x``."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(self.old + "."):
            return None
        renamed = self.new + fullname[len(self.old) :]
        real = importlib.util.find_spec(renamed)
        if real is None:
            return None
        spec = importlib.machinery.ModuleSpec(fullname, _AliasLoader(renamed), origin=real.origin)
        spec.submodule_search_locations = real.submodule_search_locations
        return spec


def alias_package(old: str, new: str) -> None:
    """Make the package being imported as ``old`` the package ``new``, its modules included; call it
    from ``old/__init__.py``. Warns once that ``old`` goes in the next release."""
    warnings.warn(
        f"the package {old!r} is now {new!r} (python -m {new} ...); the old name goes in the next release",
        FutureWarning,
        stacklevel=3,
    )
    if not any(isinstance(f, _AliasFinder) and f.old == old for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder(old, new))
    sys.modules[old] = importlib.import_module(new)
