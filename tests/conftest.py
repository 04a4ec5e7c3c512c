"""pytester, for the self-tests that run the gate in a directory of their own.

Declared here, not in tests/selftest/conftest.py next to them: pytest refuses
``pytest_plugins`` in a conftest it loads only while collecting, which that one is when
pytest is given tests/ (or nothing)."""

pytest_plugins = ("pytester",)
