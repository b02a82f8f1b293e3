"""Entry point of the ``keras-scale`` command (``keras-scale = "keras_scale_cli:main"`` in pyproject.toml).

It is a top-level module, imported before the ``keras_scale`` package, so that ``import keras_scale`` can see
that this process is the command line and import only its TensorFlow-free part: ``keras-scale version`` and every
``--help`` then start without TensorFlow, and ``keras-scale doctor`` still runs where TensorFlow crashes or hangs at
import. Every program that imports ``keras_scale`` itself gets the full package (see ``keras_scale/__init__.py``).

Example:
    $ keras-scale --version
    $ python -m keras_scale_cli help doctor
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``keras-scale`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    Example:
        main(["--version"])
        # keras-scale 0.1.0
    """
    from keras_scale.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
