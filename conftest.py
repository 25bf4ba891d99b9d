"""Shared by the test suite and the docstring examples in python/lloyal."""

# A plugin, not fixtures here: they must also reach the doctests of an
# installed lloyal (make test-wheel), which lie outside this directory.
pytest_plugins = ["tests.doctest_model", "tests.windows_skips"]
