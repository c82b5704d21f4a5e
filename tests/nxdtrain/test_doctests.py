"""The examples in nxdtrain's docstrings run and stay true."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["config.options", "parallel.context", "data.rows", "device", "parallel.dist", "data.epochs", "model.stage", "optim",
           "config.preflight", "model.rope", "parallel.tp_group", "config.checks"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(f"nxdtrain.{name}"))
    assert result.attempted > 0 and result.failed == 0
