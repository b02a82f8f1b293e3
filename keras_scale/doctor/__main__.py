"""``python -m keras_scale.doctor``: the same as ``keras-scale doctor``."""
import sys

from keras_scale.doctor.command import cli

if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
