"""The commands the demo tells you to run at its end run as printed, also when the virtual environment was never
activated (``make demo`` runs ``.venv/bin/python``): each is the script beside the Python that ran the demo, or on
PATH."""
import importlib.util
import os
import shutil
import sys

from tests.conftest import REPO_ROOT

_spec = importlib.util.spec_from_file_location("quickstart", os.path.join(REPO_ROOT, "examples", "quickstart.py"))
quickstart = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(quickstart)


def _commands(text: str):
    return [line.split()[0] for line in text.splitlines()
            if line.startswith("  ") and line.split() and not line.split()[0].startswith(("#", "("))]


def test_every_printed_command_runs_without_an_activated_venv(monkeypatch):
    bindir = os.path.dirname(sys.executable)
    if not all(os.access(os.path.join(bindir, name), os.X_OK) for name in ("tensorboard", "keras-scale")):
        import pytest

        pytest.skip("this Python has no tensorboard / keras-scale script beside it")
    monkeypatch.setenv("PATH", os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                               if os.path.realpath(p) != os.path.realpath(bindir)) or "/usr/bin")
    text = quickstart.where_to_look("runs/quickstart")
    commands = _commands(text)
    assert {os.path.basename(c) for c in commands} == {"tensorboard", "keras-scale"}, text
    for command in commands:
        assert os.access(command, os.X_OK) or shutil.which(command), (command, text)
    assert "activate" in text


def test_an_activated_venv_gets_the_plain_names(monkeypatch):
    bindir = os.path.dirname(sys.executable)
    monkeypatch.setenv("PATH", bindir + os.pathsep + os.environ["PATH"])
    for name in ("tensorboard", "keras-scale"):
        if shutil.which(name) and os.path.realpath(shutil.which(name)) == os.path.realpath(os.path.join(bindir, name)):
            assert quickstart.command(name) == name


def test_printed_commands_keep_a_path_with_a_space_in_one_argument():
    import shlex

    text = quickstart.where_to_look("runs/q s")
    lines = [shlex.split(line.split("  # ")[0]) for line in text.splitlines() if line.startswith("  ")
             and line.split() and not line.split()[0].startswith(("#", "("))]
    args = {tuple(words[1:]) for words in lines if words}
    assert ("checkpoint", "ls", os.path.join("runs/q s", "checkpoints")) in args, text
    assert ("--logdir", "runs/q s") in args and ("profile-summary", os.path.join("runs/q s", "profile")) in args, text
