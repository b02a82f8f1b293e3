"""Modules named like their main function: ``keras_scale.fit``, ``keras_scale.doctor``, ``keras_scale.remat``.

Once such a submodule has been imported (``from keras_scale.fit import prepare_dataset``, or the CLI importing
``keras_scale.doctor``), Python binds the package attribute to the module and hides the function of the same
name. :func:`forward_calls_to` makes the module callable, so ``ks.fit(...)`` works either way.
"""
from __future__ import annotations

import sys
import types


def forward_calls_to(module_name: str, function_name: str) -> None:
    """Make the module ``module_name`` callable: calling it calls its function ``function_name``.

    Example:
        >>> forward_calls_to(__name__, "fit")  # at the bottom of keras_scale/fit.py  # doctest: +SKIP
    """

    class _CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return getattr(self, function_name)(*args, **kwargs)

    sys.modules[module_name].__class__ = _CallableModule
