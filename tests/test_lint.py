"""The package has no undefined names and no unused imports (pyflakes): a bad merge fails here, not at a user's."""
import os

import pytest

pyflakes_api = pytest.importorskip("pyflakes.api")
from pyflakes import reporter as pyflakes_reporter  # noqa: E402

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "keras_scale")


class _Collect(pyflakes_reporter.Reporter):
    def __init__(self):
        self.messages = []

    def unexpectedError(self, filename, message):
        self.messages.append(f"{filename}: {message}")

    def syntaxError(self, filename, message, lineno, offset, text):
        self.messages.append(f"{filename}:{lineno}: {message}")

    def flake(self, message):
        self.messages.append(str(message))


def test_package_has_no_undefined_names_or_unused_imports():
    collect = _Collect()
    pyflakes_api.checkRecursive([PACKAGE], collect)
    assert collect.messages == []
