"""The ``keras-scale`` command line.

Example:
    $ keras-scale version
    $ keras-scale doctor --json
    $ keras-scale profile-summary runs/profile

Each sub-command lives in the module it belongs to, as a ``cli(argv: list[str]) -> int`` function, and is
imported only when used (so ``doctor`` runs without TensorFlow installed).
"""
from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

# sub-command -> (module, function, one-line help)
COMMANDS = {
    "version": ("keras_scale.cli", "version_cli", "print keras_scale, TensorFlow and Keras versions"),
    "doctor": ("keras_scale.doctor", "cli", "check drivers, CUDA, GPUs, leftover processes, env variables"),
    "profile-summary": ("keras_scale.profiling", "cli", "summarize the newest profiler capture in LOGDIR"),
    "plot-lr": ("keras_scale.schedules", "cli", "plot a WarmupCosine schedule to a PNG"),
    "launch": ("keras_scale.launch", "cli", "run a script as N local MultiWorkerMirroredStrategy workers"),
}


def version_cli(argv: Sequence[str]) -> int:
    """Print the versions of keras_scale, TensorFlow and Keras.

    Example:
        >>> version_cli([])  # doctest: +SKIP
        keras_scale 0.1.0
    """
    from keras_scale import __version__

    print(f"keras_scale {__version__}")
    for name in ("tensorflow", "keras"):
        try:
            mod = importlib.import_module(name)
            print(f"{name} {mod.__version__}")
        except ImportError:
            print(f"{name} not installed")
    return 0


def _usage() -> str:
    lines = ["usage: keras-scale <command> [args]", "", "commands:"]
    for name, (_, _, help_text) in COMMANDS.items():
        lines.append(f"  {name:<16} {help_text}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``keras-scale`` / ``python -m keras_scale``.

    Example:
        >>> main(["version"])  # doctest: +SKIP
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"keras-scale: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
