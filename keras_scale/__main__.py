"""``python -m keras_scale <command>``: same as the ``keras-scale`` console script."""
import sys

from keras_scale.cli import main

if __name__ == "__main__":
    sys.exit(main())
