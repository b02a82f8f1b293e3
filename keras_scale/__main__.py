"""``python -m keras_scale <command>``: the ``keras-scale`` command.

``python -m keras_scale`` imports the whole package (TensorFlow included) before the command runs; the
``keras-scale`` script and ``python -m keras_scale_cli`` start without it.
"""
import sys

from keras_scale.cli import main

if __name__ == "__main__":
    sys.exit(main())
