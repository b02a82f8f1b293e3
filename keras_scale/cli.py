"""The ``keras-scale`` command line.

Example:
    $ keras-scale --version
    $ keras-scale help doctor
    $ keras-scale doctor --json
    $ keras-scale plot-lr --peak-lr 0.4 --total-steps 9000 --warmup-steps 500 -o lr.png
    $ keras-scale launch --workers 2 -- python train.py
    $ keras-scale checkpoint ls runs/exp1/ckpt

Each sub-command is a function below that imports what it needs when it runs. ``version``, ``help`` and every
``--help`` import no TensorFlow (the ``keras-scale`` entry point, :mod:`keras_scale_cli`, keeps ``import
keras_scale`` TensorFlow-free too); ``plot-lr`` imports it only after its arguments were checked.

Exit status: 0 success, 1 the command failed (``doctor`` found an error, a worker failed, ...), 2 bad usage.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import math
import os
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from keras_scale.output import say


def _installed_version(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_cli(argv: Sequence[str]) -> int:
    """``keras-scale version``: the versions of keras_scale, TensorFlow and Keras, read without importing them.

    ``keras-scale --version`` prints the same.

    Example:
        version_cli([])
        # keras-scale 0.1.0
        # tensorflow 2.21.0
        # keras 3.15.0
    """
    parser = argparse.ArgumentParser(prog="keras-scale version", description=_HELP["version"])
    parser.parse_args(list(argv))
    from keras_scale import __version__

    print(f"keras-scale {__version__}")
    for name in ("tensorflow", "keras"):
        print(f"{name} {_installed_version(name) or 'not installed'}")
    return 0


def doctor_cli(argv: Sequence[str]) -> int:
    """``keras-scale doctor [--json] [--no-tensorflow]``: see :func:`keras_scale.doctor.cli`."""
    from keras_scale.doctor import cli

    return int(cli(argv) or 0)


def profile_summary_cli(argv: Sequence[str]) -> int:
    """``keras-scale profile-summary LOGDIR``: see :func:`keras_scale.profiling.cli`."""
    from keras_scale.profiling import cli

    return int(cli(argv) or 0)


def launch_cli(argv: Sequence[str]) -> int:
    """``keras-scale launch --workers N -- CMD ...``: see :func:`keras_scale.launch.cli`."""
    from keras_scale.launch import cli

    return int(cli(argv) or 0)


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = kind(text)
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def plot_lr_cli(argv: Sequence[str]) -> int:
    """``keras-scale plot-lr --peak-lr 1e-3 --total-steps 10000 [--warmup-steps 500] [-o lr.png]``.

    Plots :class:`keras_scale.WarmupCosine` to a PNG. Bad arguments and a missing matplotlib give one
    ``keras-scale plot-lr: error: ...`` line (exit status 2 and 1), before TensorFlow is imported.

    Example:
        $ keras-scale plot-lr --peak-lr 0.4 --total-steps 9000 --warmup-steps 500 -o lr.png
        wrote lr.png
    """
    p = argparse.ArgumentParser(prog="keras-scale plot-lr", description=_HELP["plot-lr"])
    p.add_argument("--peak-lr", type=_positive(float), required=True, help="the learning rate after warmup")
    p.add_argument("--total-steps", type=_positive(int), required=True, help="optimizer updates of the whole run")
    p.add_argument("--warmup-steps", type=int, default=0, help="updates of linear warmup (default 0)")
    p.add_argument("--initial-lr", type=float, default=0.0, help="learning rate at the start of warmup")
    p.add_argument("--final-lr", type=float, default=0.0, help="learning rate at the end of the cosine")
    p.add_argument("-o", "--output", default="lr.png", help="PNG file to write (default lr.png)")
    a = p.parse_args(list(argv))
    if not 0 <= a.warmup_steps <= a.total_steps:
        p.error(f"--warmup-steps must be between 0 and --total-steps ({a.total_steps}), got {a.warmup_steps}")
    for flag, value in (("--initial-lr", a.initial_lr), ("--final-lr", a.final_lr)):
        if not (value >= 0 and math.isfinite(value)):
            p.error(f"{flag} must be >= 0, got {value}")
    output = a.output
    if output.endswith(os.sep) or os.path.isdir(output):
        output = os.path.join(output, "lr.png")  # a directory: the default file name in it
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):  # said before importing TensorFlow (seconds), not after
        p.error(f"-o {a.output!r}: directory {parent!r} does not exist")
    a.output = output
    if importlib.util.find_spec("matplotlib") is None:
        print("keras-scale plot-lr: error: matplotlib is not installed: pip install matplotlib "
              "(or pip install 'keras-scale[plot]')", file=sys.stderr)
        return 1
    from keras_scale.schedules import WarmupCosine

    try:
        schedule = WarmupCosine(a.peak_lr, a.total_steps, a.warmup_steps, a.initial_lr, a.final_lr)
        say(f"wrote {schedule.plot(a.output)}")
    except (ValueError, ImportError, OSError) as e:
        print(f"keras-scale plot-lr: error: {e}", file=sys.stderr)
        return 1
    return 0


def checkpoint_cli(argv: Sequence[str]) -> int:
    """``keras-scale checkpoint ls DIR`` | ``keras-scale checkpoint export DIR [--step N] --model M --to FILE``.

    ``ls`` lists a ChiefCheckpoint directory: each committed checkpoint (number, epoch and batch, size), the one a
    resumed ``fit`` starts from, the kept best ones, problems and orphan files. ``export`` builds the model from
    ``--model`` (a ``.keras`` file, or ``module:function`` returning the model), loads the checkpoint into it by
    variable path (:func:`keras_scale.load_checkpoint`) and writes ``--to``: ``*.weights.h5`` (weights) or
    ``*.keras`` (the whole model). Arguments are checked before TensorFlow is imported.

    Example:
        $ keras-scale checkpoint ls runs/exp1/ckpt
        $ keras-scale checkpoint export runs/exp1/ckpt --model train:make_model --to exp1.weights.h5
    """
    p = argparse.ArgumentParser(prog="keras-scale checkpoint", description=_HELP["checkpoint"])
    sub = p.add_subparsers(dest="action", required=True)
    ls = sub.add_parser("ls", help="list the checkpoints of a ChiefCheckpoint directory")
    ls.add_argument("directory", help="the directory given to ChiefCheckpoint")
    ls.add_argument("--json", action="store_true", help="print JSON")
    ex = sub.add_parser("export", help="write a checkpoint as model.weights.h5 or model.keras")
    ex.add_argument("directory", help="the directory given to ChiefCheckpoint, or one checkpoint's prefix")
    ex.add_argument("--step", type=int, default=None, help="the checkpoint number (default: the newest)")
    ex.add_argument("--model", required=True,
                    help="the model to load into: a .keras file, or module:function returning the model (run from "
                         "the directory the module is imported from)")
    ex.add_argument("--to", required=True, help="output file: *.weights.h5 or *.keras")
    a = p.parse_args(list(argv))
    from keras_scale.storage import is_local  # (no TensorFlow)

    if is_local(a.directory) and not os.path.exists(a.directory) and not os.path.exists(a.directory + ".index"):
        p.error(f"{a.directory!r} does not exist")
    if a.action == "ls" and is_local(a.directory) and not os.path.isdir(a.directory):
        p.error(f"{a.directory!r} is not a directory: ls lists the directory given to ChiefCheckpoint "
                f"(here probably {os.path.dirname(a.directory) or '.'!r})")
    if a.action == "export":
        if not (a.to.endswith(".weights.h5") or a.to.endswith(".keras")):
            p.error(f"--to {a.to!r}: give a file ending in .weights.h5 or .keras")
        if not (a.model.endswith(".keras") or ":" in a.model):
            p.error(f"--model {a.model!r}: give a .keras file or module:function")
    from keras_scale.callbacks.checkpoint import export
    importlib.import_module("keras_scale.serializables")  # a .keras file keras_scale wrote names its classes

    try:
        return export.cli(a)
    except (OSError, ValueError, ImportError, AttributeError) as e:
        print(f"keras-scale checkpoint: error: {e}", file=sys.stderr)
        return 1


_HELP = {
    "version": "print the keras_scale, TensorFlow and Keras versions",
    "doctor": "check drivers, CUDA, GPUs, leftover processes, env variables",
    "profile-summary": "summarize the newest profiler capture in LOGDIR",
    "plot-lr": "plot a WarmupCosine learning-rate schedule to a PNG",
    "launch": "run a command as N local MultiWorkerMirroredStrategy workers",
    "checkpoint": "list a ChiefCheckpoint directory (ls) or export a checkpoint to .weights.h5/.keras (export)",
    "help": "show the help of a command: keras-scale help COMMAND",
}

COMMANDS: Dict[str, Callable[[Sequence[str]], int]] = {
    "version": version_cli,
    "doctor": doctor_cli,
    "profile-summary": profile_summary_cli,
    "plot-lr": plot_lr_cli,
    "launch": launch_cli,
    "checkpoint": checkpoint_cli,
}


def _usage() -> str:
    lines = ["usage: keras-scale [--version] [--help] COMMAND [ARGS]", "", "commands:"]
    for name in list(COMMANDS) + ["help"]:
        lines.append(f"  {name:<16} {_HELP[name]}")
    lines += ["", "`keras-scale help COMMAND` or `keras-scale COMMAND --help` shows a command's options."]
    return "\n".join(lines)


def _help_usage() -> str:
    lines = ["usage: keras-scale help [COMMAND]", "", _HELP["help"] + " (without COMMAND: list the commands)", "",
             "commands:"]
    lines += [f"  {name:<16} {_HELP[name]}" for name in COMMANDS]
    return "\n".join(lines)


def _unknown(name: str) -> int:
    print(f"usage: keras-scale [--version] [--help] COMMAND [ARGS]\nkeras-scale: error: unknown command {name!r} "
          f"(choose from {', '.join([*COMMANDS, 'help'])}; `keras-scale --help` lists them)", file=sys.stderr)
    return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``keras-scale``: run one sub-command; returns its exit status.

    A reader that stops early (``keras-scale --help | head -1``) ends the command quietly, with no
    ``BrokenPipeError`` traceback (exit status 1, as Python's documentation advises).

    Example:
        main(["--version"])
        # keras-scale 0.1.0
        # tensorflow 2.21.0
        # keras 3.15.0
    """
    try:
        code = _main(argv)
        sys.stdout.flush()  # inside the try: a closed pipe fails here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        try:  # the interpreter flushes stdout again at exit: point it at /dev/null first
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # noqa: PERF203 - a stdout without a file descriptor (in-process callers)
            pass
        return 1


def _main(argv: Optional[Sequence[str]]) -> int:
    args: List[str] = list(sys.argv[1:] if argv is None else argv)
    if not args:  # a usage error, as for any command missing its argument
        print(_usage(), file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if args[0] in ("-V", "--version"):
        return version_cli([])
    if args[0] == "help":
        if len(args) == 1:
            print(_usage())
            return 0
        if args[1] in ("help", "-h", "--help"):
            print(_help_usage())
            return 0
        if args[1] not in COMMANDS:
            return _unknown(args[1])
        args = [args[1], "--help"]
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        return _unknown(name)
    try:
        return int(COMMANDS[name](rest) or 0)
    except SystemExit as e:  # argparse: --help (0) and usage errors (2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


__all__: Tuple[str, ...] = ("main", "COMMANDS")

if __name__ == "__main__":
    sys.exit(main())
