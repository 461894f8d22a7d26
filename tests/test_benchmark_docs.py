"""The examples in the benchmarks' docstrings run (as the recipes' do in test_recipes)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import benchmarks


def _benchmark_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__, "benchmarks."))


@pytest.mark.parametrize("name", _benchmark_modules())
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
