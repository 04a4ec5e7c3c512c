"""Fixtures of the self-tests; their helpers are in ``harness``."""

from __future__ import annotations

import pathlib

import pytest


@pytest.fixture
def gate_dir(pytester, monkeypatch) -> pathlib.Path:
    """A pytester directory whose runs of the gate (``harness``) see the repository, the
    toy spec and the toy runs' cache."""
    # Imported here, not with this module: pytest loads a conftest before attncheck's plugin
    # configures the process, and NumPy and jax must start after that (attncheck.env).
    from tests.selftest import harness

    return harness.setup_gate_dir(pytester, monkeypatch)
