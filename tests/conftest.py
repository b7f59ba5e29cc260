"""Fixtures every test folder shares; the plain functions and argument lists are in `tests/harness.py`.

This folder goes first on `sys.path`, so `from harness import ...` works from unit, integration,
contract and gpu tests alike.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One small random qwen2 checkpoint (`miles tiny-model` defaults, seed 0) for the whole session.
    Tests that change the weights on disk make their own."""
    from miles.models.tiny import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "qwen2"))
