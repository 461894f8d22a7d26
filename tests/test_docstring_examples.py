"""The examples in the docstrings of the recipes and the benchmarks run (the package's
own run as doctests of ``lightning_acgc``, pytest's ``--doctest-modules``)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import benchmarks
import recipes


def _modules() -> list[str]:
    found = [m.name for m in pkgutil.walk_packages(recipes.__path__, "recipes.")]
    found += [m.name for m in pkgutil.iter_modules(benchmarks.__path__, "benchmarks.")]
    return sorted(found)


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
