"""``python -m keras_scale <command>``: the ``keras-scale`` command.

Like the ``keras-scale`` script (:mod:`keras_scale_cli`), it starts without TensorFlow: ``keras_scale/__init__.py``
sees that it is imported for ``python -m keras_scale`` and imports only its TensorFlow-free part, so ``python -m
keras_scale doctor`` survives a TensorFlow that crashes at import and ``--no-tensorflow`` stays fast.

Example:
    $ python -m keras_scale doctor --no-tensorflow
"""
import sys

try:
    from keras_scale_cli import main
except ImportError:  # keras_scale used from a checkout without its top-level entry module on sys.path
    from keras_scale.cli import main

if __name__ == "__main__":
    sys.exit(main())
