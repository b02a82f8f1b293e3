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
