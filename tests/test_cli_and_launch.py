"""The keras-scale command line (no TensorFlow for version/--help, one-line errors) and `keras-scale launch`
(live prefixed output, no default timeout, SIGTERM/SIGINT forwarded with real signals, exit status)."""
import importlib.metadata
import inspect
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from keras_scale.launch import launch_local_workers, make_tf_config

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
COMMANDS = ["version", "doctor", "profile-summary", "plot-lr", "launch", "checkpoint"]


def _cli(*args, timeout=120, pre=""):
    """Run the keras-scale entry point (what the console script runs) in a fresh Python."""
    code = (f"import sys; {pre}from keras_scale_cli import main; rc = main(sys.argv[1:]); "
            "print('TF_IMPORTED', 'tensorflow' in sys.modules or 'keras' in sys.modules, file=sys.stderr); "
            "sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO_ROOT, env=ENV)


# ---- the command line ----------------------------------------------------------------------------------------

def test_version_help_and_every_help_without_tensorflow():
    argvs = [["--version"], ["version"], ["--help"], ["help"], ["help", "help"], ["help", "--help"]] + \
            [["help", c] for c in COMMANDS] + [[c, "--help"] for c in COMMANDS]
    code = ("import sys, io, json, contextlib; from keras_scale_cli import main; out = []\n"
            f"for argv in {argvs!r}:\n"
            "    buf = io.StringIO()\n"
            "    with contextlib.redirect_stdout(buf): rc = main(argv)\n"
            "    out.append([argv, rc, buf.getvalue()])\n"
            "print(json.dumps({'runs': out, 'tf': 'tensorflow' in sys.modules or 'keras' in sys.modules}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                          env=ENV)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["tf"] is False, "version/--help imported TensorFlow or Keras"
    runs = {" ".join(argv): (rc, text) for argv, rc, text in report["runs"]}
    assert all(rc == 0 for rc, _ in runs.values()), {k: rc for k, (rc, _) in runs.items()}
    import keras_scale

    assert runs["--version"][1] == runs["version"][1]  # one answer, one name
    assert runs["version"][1].splitlines() == [f"keras-scale {keras_scale.__version__}",
                                               f"tensorflow {importlib.metadata.version('tensorflow')}",
                                               f"keras {importlib.metadata.version('keras')}"]
    for c in COMMANDS:
        assert runs[f"help {c}"][1] == runs[f"{c} --help"][1]
        assert runs[f"help {c}"][1].startswith(f"usage: keras-scale {c}")
    assert all(c in runs["--help"][1] for c in COMMANDS)
    assert runs["help help"][1] == runs["help --help"][1]
    assert runs["help help"][1].startswith("usage: keras-scale help [COMMAND]")
    assert all(f"  {c} " in runs["help help"][1] for c in COMMANDS)


def test_python_m_keras_scale_still_runs_commands():
    out = subprocess.run([sys.executable, "-m", "keras_scale", "version"], capture_output=True, text=True,
                         timeout=120, cwd=REPO_ROOT, env=ENV)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("keras-scale ") and "tensorflow" in out.stdout


def test_a_reader_that_stops_early_gets_no_traceback():
    """``keras-scale --help | head -1``: the pipe closes before the command writes; it ends quietly."""
    code = "import sys; from keras_scale_cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=REPO_ROOT, env=ENV)
    proc.stdout.close()  # the reader is gone before the first write
    _, err = proc.communicate(timeout=120)
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()
    assert proc.returncode == 1


@pytest.mark.parametrize("args, message", [
    (["--peak-lr", "0", "--total-steps", "10"], "argument --peak-lr: must be > 0"),
    (["--peak-lr", "0.1", "--total-steps", "ten"], "argument --total-steps: invalid int value"),
    (["--peak-lr", "0.1", "--total-steps", "10", "--warmup-steps", "50"], "--warmup-steps must be between 0 and"),
    (["--total-steps", "10"], "the following arguments are required: --peak-lr"),
    (["--peak-lr", "0.1", "--total-steps", "10", "-o", "/no/such/dir/lr.png"], "directory '/no/such/dir' does not"),
])
def test_plot_lr_bad_arguments_one_line_error_without_tensorflow(args, message):
    out = _cli("plot-lr", *args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines[-2].startswith("keras-scale plot-lr: error: ") and message in lines[-2], out.stderr
    assert "Traceback" not in out.stderr and lines[-1] == "TF_IMPORTED False"


def test_plot_lr_without_matplotlib_one_line_error(tmp_path):
    out = _cli("plot-lr", "--peak-lr", "0.1", "--total-steps", "10", "-o", str(tmp_path / "lr.png"),
               pre="sys.modules['matplotlib'] = None; ")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == ["keras-scale plot-lr: error: matplotlib is not installed: pip install "
                                               "matplotlib (or pip install 'keras-scale[plot]')",
                                               "TF_IMPORTED False"]
    assert not (tmp_path / "lr.png").exists()


@pytest.mark.slow
def test_plot_lr_writes_the_png(tmp_path):
    pytest.importorskip("matplotlib")  # the `plot` extra
    out = _cli("plot-lr", "--peak-lr", "0.1", "--total-steps", "100", "-o", str(tmp_path / "plots") + "/")
    assert out.returncode == 2  # a directory that does not exist: said before TF is imported
    (tmp_path / "plots").mkdir()
    # a file name, then a directory: two runs of the command in ONE Python (one TensorFlow start-up, not two)
    plots = str(tmp_path / "plots") + "/"
    out = _cli("plot-lr", "--peak-lr", "0.1", "--total-steps", "100", "--warmup-steps", "10", "-o",
               str(tmp_path / "lr.png"),
               pre=f"main2 = __import__('keras_scale_cli').main; assert main2(['plot-lr', '--peak-lr', '0.1', "
                   f"'--total-steps', '100', '-o', {plots!r}]) == 0; ")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "lr.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "plots" / "lr.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_command_fails_with_usage():
    out = _cli("nope")
    assert out.returncode == 2 and "keras-scale: error: unknown command 'nope'" in out.stderr
    out = _cli("help", "nope")
    assert out.returncode == 2 and "unknown command 'nope'" in out.stderr and "help;" in out.stderr


@pytest.mark.slow
def test_import_registers_keras_classes_in_a_package_run_with_python_m(tmp_path):
    import keras

    import keras_scale as ks

    model = ks.wrap(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]), accum=2)
    model.compile(optimizer=keras.optimizers.SGD(ks.WarmupCosine(0.1, total_steps=10)), loss="mse",
                  metrics=["mae"])
    model.save(str(tmp_path / "m.keras"))
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(
        "import sys\nimport keras_scale\nimport keras\n"
        "m = keras.models.load_model(sys.argv[1])\n"
        "print(type(m).__name__, type(m.optimizer._learning_rate).__name__)\n")
    out = subprocess.run([sys.executable, "-m", "pkg", str(tmp_path / "m.keras")], capture_output=True, text=True,
                         timeout=120, cwd=str(tmp_path), env=ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["AccumulatingModel", "WarmupCosine"]


def test_public_functions_stay_callable_after_their_module_is_imported():
    import keras_scale as ks
    import keras_scale.doctor  # noqa: F401
    import keras_scale.fit  # noqa: F401
    from keras_scale.fit import prepare_dataset  # noqa: F401  (the module's other names stay importable)

    assert callable(ks.fit) and ks.fit.__module__ == "keras_scale.fit"
    assert callable(ks.doctor) and ks.doctor.__module__ == "keras_scale.doctor"


# ---- launch --------------------------------------------------------------------------------------------------

def test_launch_sets_distinct_tf_config_per_worker():
    code = ("import json, os; c = json.loads(os.environ['TF_CONFIG']); "
            "print(c['task']['index'], len(c['cluster']['worker']))")
    results = launch_local_workers([sys.executable, "-c", code], num_workers=3, timeout_s=60, check=True)
    assert sorted(r.stdout.strip() for r in results) == ["0 3", "1 3", "2 3"]
    assert make_tf_config([1, 2], 1)["task"] == {"type": "worker", "index": 1}


@pytest.mark.slow
def test_launch_kills_the_rest_when_one_worker_dies():
    code = "import os, sys, time; c = os.environ['TF_CONFIG']; sys.exit(3) if '\"index\": 1' in c else time.sleep(600)"
    results = launch_local_workers([sys.executable, "-c", code], num_workers=2, timeout_s=120, grace_s=1)
    assert results[1].returncode == 3
    assert results[0].returncode != 0  # killed, not left hanging for 600 s


def test_launch_has_no_default_time_limit():
    from keras_scale.launch import cli

    assert inspect.signature(launch_local_workers).parameters["timeout_s"].default is None
    assert "default: no limit" in inspect.getsource(cli)


WORKER = r"""
import json, os, signal, sys, time
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
mode = sys.argv[1]
if mode == "graceful":
    def on_term(signum, frame):
        print(f"worker {index} got signal {signum}, saving", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
elif mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
print(f"ready {os.getpid()}", flush=True)
print(f"to stderr {index}", file=sys.stderr, flush=True)
while not os.path.exists("go"):
    time.sleep(0.05)
print("done", flush=True)
sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 and index == 1 else 0)
"""


class Launcher:
    """`keras-scale launch` in a subprocess, its stdout read line by line as it comes."""

    def __init__(self, tmp_path, worker_args, launch_args=(), through_shell=False):
        (tmp_path / "worker.py").write_text(WORKER)
        code = "import sys; from keras_scale_cli import main; sys.exit(main(sys.argv[1:]))"
        worker = [sys.executable, str(tmp_path / "worker.py"), *worker_args]
        if through_shell:  # a wrapper: bash dies on SIGTERM, its Python child lives on
            worker = ["bash", "-c", " ".join(worker)]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, "launch", "--workers", "2", *launch_args, "--", *worker],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path),
            env=dict(ENV, PYTHONPATH=REPO_ROOT))
        self.lines: "queue.Queue[str]" = queue.Queue()
        self.seen = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_for(self, predicate, timeout_s=60):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                continue
            self.seen.append(line)
            if predicate(self.seen):
                return
        raise AssertionError(f"launcher output so far: {self.seen}")

    def ready_pids(self, workers=2):
        self.wait_for(lambda seen: sum(s.startswith("[worker ") and " ready " in s for s in seen) == workers)
        return [int(s.split()[-1]) for s in self.seen if " ready " in s]

    def finish(self, timeout_s=60):
        rc = self.proc.wait(timeout=timeout_s)
        time.sleep(0.2)
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return rc, self.proc.stderr.read()


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_launch_streams_prefixed_output_live(tmp_path):
    launcher = Launcher(tmp_path, ["plain"])
    pids = launcher.ready_pids()  # seen while both workers still wait for "go": the output is live
    assert all(not _gone(pid) for pid in pids)
    (tmp_path / "go").write_text("")
    rc, stderr = launcher.finish()
    assert rc == 0, stderr
    assert sorted(s for s in launcher.seen if s.endswith("done")) == ["[worker 0] done", "[worker 1] done"]
    assert "[worker 0] to stderr 0" in stderr and "[worker 1] to stderr 1" in stderr


def test_launch_exit_status_is_the_failing_workers(tmp_path):
    launcher = Launcher(tmp_path, ["plain", "7"])
    launcher.ready_pids()
    (tmp_path / "go").write_text("")
    rc, stderr = launcher.finish()
    assert rc == 7, stderr
    assert "worker 1: exit 7" in stderr


@pytest.mark.parametrize("signum, expected", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_launch_forwards_a_signal_and_workers_stop_cleanly(tmp_path, signum, expected):
    launcher = Launcher(tmp_path, ["graceful"])
    pids = launcher.ready_pids()
    launcher.proc.send_signal(signum)
    rc, stderr = launcher.finish()
    assert rc == expected, stderr
    saved = sorted(s for s in launcher.seen if "saving" in s)
    assert saved == [f"[worker {i}] worker {i} got signal {int(signum)}, saving" for i in (0, 1)], launcher.seen
    assert all(_gone(pid) for pid in pids)


def test_launch_kills_workers_that_ignore_the_signal_after_the_grace_period(tmp_path):
    launcher = Launcher(tmp_path, ["stubborn"], ["--grace-s", "2"])
    pids = launcher.ready_pids()
    start = time.monotonic()
    launcher.proc.send_signal(signal.SIGTERM)
    rc, stderr = launcher.finish()
    assert rc == 143, stderr
    assert time.monotonic() - start < 20  # 2 s grace, then SIGKILL
    assert "exit -9" in stderr
    assert all(_gone(pid) for pid in pids)


@pytest.mark.slow
def test_launch_grace_period_holds_for_a_wrapped_worker_and_a_missing_command_is_one_line(tmp_path):
    launcher = Launcher(tmp_path, ["stubborn"], ["--grace-s", "2"], through_shell=True)
    pids = launcher.ready_pids()
    start = time.monotonic()
    launcher.proc.send_signal(signal.SIGTERM)
    rc, stderr = launcher.finish()
    assert time.monotonic() - start < 15, stderr  # 2 s grace, then SIGKILL to the whole process group
    assert all(_gone(pid) for pid in pids)
    missing = subprocess.run([sys.executable, "-c", "import sys; from keras_scale_cli import main; "
                              "sys.exit(main(sys.argv[1:]))", "launch", "--workers", "1", "--", "/nonexistent/cmd"],
                             capture_output=True, text=True, env=dict(ENV, PYTHONPATH=REPO_ROOT), timeout=60)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "cannot run '/nonexistent/cmd'" in missing.stderr


@pytest.mark.slow
def test_launch_timeout_is_opt_in_and_stops_the_workers(tmp_path):
    (tmp_path / "worker.py").write_text(WORKER)
    code = "import sys; from keras_scale_cli import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run([sys.executable, "-c", code, "launch", "--workers", "2", "--timeout-s", "3", "--grace-s",
                          "2", "--", sys.executable, str(tmp_path / "worker.py"), "plain"],
                         capture_output=True, text=True, cwd=str(tmp_path), env=dict(ENV, PYTHONPATH=REPO_ROOT),
                         timeout=60)
    assert out.returncode == 124, out.stderr
    assert "(timed out)" in out.stderr


@pytest.mark.slow
def test_launch_function_reraises_ctrl_c_after_stopping_the_workers(tmp_path):
    # the library function (not the command line): Ctrl-C stops the workers, then raises KeyboardInterrupt as usual
    (tmp_path / "worker.py").write_text(WORKER)
    code = (
        "import os, signal, sys, threading\n"
        "from keras_scale.launch import launch_local_workers\n"
        "threading.Timer(3.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()\n"
        "try:\n"
        "    launch_local_workers([sys.executable, 'worker.py', 'graceful'], num_workers=2, grace_s=5)\n"
        "except KeyboardInterrupt:\n"
        "    print('KeyboardInterrupt after the workers stopped')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(tmp_path),
                         env=dict(ENV, PYTHONPATH=REPO_ROOT), timeout=60)
    assert "KeyboardInterrupt after the workers stopped" in out.stdout, out.stderr


def test_python_m_keras_scale_doctor_does_not_import_tensorflow_first(tmp_path):
    """`python -m keras_scale doctor` starts like the `keras-scale` script: a TensorFlow that aborts at import
    (a broken install) cannot kill it, and --no-tensorflow never imports TensorFlow."""
    fake = tmp_path / "tensorflow"
    fake.mkdir()
    (fake / "__init__.py").write_text("import os\nos.abort()\n")
    env = dict(ENV, PYTHONPATH=str(tmp_path) + os.pathsep + ENV["PYTHONPATH"])
    out = subprocess.run([sys.executable, "-m", "keras_scale", "doctor", "--no-tensorflow", "--json", "-q"],
                         capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, env=env)
    assert out.returncode in (0, 1), (out.returncode, out.stderr[-2000:])
    assert json.loads(out.stdout)["tensorflow_probed"] is False


def test_doctor_piped_into_a_reader_that_stops_early_exits_quietly():
    """`keras-scale doctor | head -1`: the reader closes the pipe; no BrokenPipeError traceback."""
    code = "import sys; from keras_scale_cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, "doctor", "--no-tensorflow", "--json", "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO_ROOT, env=ENV)
    proc.stdout.close()  # the reader is gone before the report is printed
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err.decode() and "BrokenPipe" not in err.decode(), err.decode()[-2000:]
    assert proc.returncode in (0, 1)
