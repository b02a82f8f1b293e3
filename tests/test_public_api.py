"""The public API: every exported name resolves, is documented with an example, and is type-hinted."""
import inspect

import pytest

import keras_scale as ks

NAMES = [n for n in ks.__all__ if n not in ("data", "__version__")]


@pytest.mark.parametrize("name", NAMES)
def test_export_has_docstring_with_example(name):
    obj = getattr(ks, name)
    doc = inspect.getdoc(obj) or ""
    if inspect.isclass(obj) and issubclass(obj, Exception):
        assert doc, f"{name} needs a docstring"
        return
    assert "Example" in doc or ">>>" in doc, f"{name}'s docstring needs a short example"


@pytest.mark.parametrize("name", NAMES)
def test_export_is_type_hinted(name):
    obj = getattr(ks, name)
    if inspect.isclass(obj):
        if issubclass(obj, Exception):
            return
        obj = obj.__init__
    sig = inspect.signature(obj)
    missing = [p for p in sig.parameters.values()
               if p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               and p.annotation is inspect.Parameter.empty]
    assert not missing, f"{name}: parameters without type hints: {[p.name for p in missing]}"


def test_data_module_functions_documented():
    for fn in (ks.data.check, ks.data.benchmark, ks.data.optimize):
        assert "Example" in (inspect.getdoc(fn) or "") or ">>>" in (inspect.getdoc(fn) or "")


def _modules():
    import importlib
    import pkgutil

    yield importlib.import_module("keras_scale_cli")
    for info in pkgutil.walk_packages(ks.__path__, "keras_scale."):
        if info.name != "keras_scale.__main__":
            yield importlib.import_module(info.name)


def test_docstring_examples_are_doctests_or_plain_code():
    """A ``>>>`` example runs as a doctest (`make test`); one that cannot run (training, workers, a GPU, files) is
    a plain code block, not a doctest whose every line is skipped."""
    import doctest

    finder = doctest.DocTestFinder(exclude_empty=True)
    skipped_only, count = [], 0
    for module in _modules():
        for test in finder.find(module):
            count += len(test.examples)
            if test.examples and all(e.options.get(doctest.SKIP) for e in test.examples):
                skipped_only.append(test.name)
    assert not skipped_only, f"examples that never run: write them as plain code blocks: {skipped_only}"
    assert count > 100  # the finder saw the examples


def test_make_test_runs_the_docstring_examples():
    import os

    makefile = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "Makefile")).read()
    doctest_line = next(line for line in makefile.splitlines() if line.startswith("DOCTEST"))
    assert "--doctest-modules" in doctest_line and "--timeout=" in doctest_line
    target = makefile.split("\ntest: install\n", 1)[1].split("\n\n", 1)[0]
    assert "$(DOCTEST)" in target and " tests" in target
