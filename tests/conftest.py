"""Session-wide test set-up.

- Splits the CPU into 2 logical devices BEFORE TensorFlow initialises, so any test can build
  ``tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])`` (fixture ``mirrored``).
- Multi-worker tests use :func:`keras_scale.launch.launch_local_workers` (fixture ``run_workers``), which
  starts N processes on 127.0.0.1 with ``TF_CONFIG`` and always cleans them up. Mark them ``@pytest.mark.slow``.
"""
import gc
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")  # bitwise-reproducible CPU kernels for equivalence tests

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
)

import keras  # noqa: E402

from keras_scale.launch import launch_local_workers  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Keras's clear_session() runs a full gc.collect() unless told not to: 0.5-2 s on this suite's heap (TensorFlow
# loaded), after each of ~1,000 tests. Keras's state is cleared after every test and the young generations are
# collected; full collections are Python's own (its thresholds). An explicit full collection every 25 tests took
# 9-101 s each in 4 pytest-xdist workers on 2 cores (the slow clean-ups listed at the end of a run): full
# collections are left to Python's own thresholds (FULL_GC_EVERY = 0; N > 0 forces one every N tests).
FULL_GC_EVERY = 0
_tests_since_full_gc = [0]


_SLOW_CLEANUPS = []  # (seconds, what, test): clean-ups over SLOW_CLEANUP_S, listed at the end of the run
SLOW_CLEANUP_S = 5.0


@pytest.fixture(autouse=True)
def _seed_and_clear(request):
    import time

    keras.utils.set_random_seed(1234)
    yield
    start = time.perf_counter()
    keras.backend.clear_session(free_memory=False)
    cleared = time.perf_counter()
    _tests_since_full_gc[0] += 1
    full = bool(FULL_GC_EVERY) and _tests_since_full_gc[0] >= FULL_GC_EVERY
    if full:
        _tests_since_full_gc[0] = 0
        gc.collect()
    else:
        gc.collect(1)
    done = time.perf_counter()
    for seconds, what in ((cleared - start, "clear_session"), (done - cleared, "full gc" if full else "gc(1)")):
        if seconds > SLOW_CLEANUP_S:  # (reported by the process that prints, also under pytest-xdist)
            request.node.user_properties.append(
                ("slow_cleanup", (round(seconds, 1), f"{what} ({len(gc.get_objects())} objects tracked)")))


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        for key, value in report.user_properties:
            if key == "slow_cleanup":
                _SLOW_CLEANUPS.append((value[0], value[1], report.nodeid))


def pytest_terminal_summary(terminalreporter):
    for seconds, what, test in sorted(_SLOW_CLEANUPS, reverse=True)[:10]:
        terminalreporter.write_line(f"slow clean-up: {seconds:.1f} s {what} after {test}")


def pytest_sessionfinish(session, exitstatus):
    gc.collect()  # what the last tests left is freed while TensorFlow is whole, not during interpreter shutdown


_MIRRORED = []


@pytest.fixture
def mirrored():
    """A 2-replica ``MirroredStrategy`` on the 2 logical CPUs, ONE per test session.

    TF keys its collective instances per strategy object from the same counter, so a second
    MirroredStrategy with collective all-reduce in one process can collide with the first ("Shape mismatch
    in the collective instance"). Use this fixture rather than creating your own MirroredStrategy.
    """
    if not _MIRRORED:
        _MIRRORED.append(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
    return _MIRRORED[0]


def _worker_env(extra=None):
    env = {
        "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "TF_ENABLE_ONEDNN_OPTS": "0",
        "CUDA_VISIBLE_DEVICES": "",
    }
    env.update(extra or {})
    return env


@pytest.fixture(scope="session")
def chief_only_job(tmp_path_factory):
    """``(results, directory)`` of ONE 2-worker job shared by several callbacks' chief-only tests.

    ``tests/_chief_only_job.py`` runs each callback's multi-worker scenario in turn in the same 2 processes
    (each part writes ``<part>_<index>.json`` into ``directory``): one pair of TensorFlow start-ups and one cluster
    set-up instead of one per test. Started by the first test that asks for it.
    """
    directory = tmp_path_factory.mktemp("chief_only_job")
    results = launch_local_workers([sys.executable, os.path.join(REPO_ROOT, "tests", "_chief_only_job.py"),
                                    str(directory)], num_workers=2, timeout_s=300, env=_worker_env(),
                                   cwd=str(directory), check=True)
    return results, directory


@pytest.fixture
def run_workers(tmp_path):
    """``run_workers(script_text, num_workers=2, args=(), timeout_s=300) -> list[WorkerResult]``.

    Writes ``script_text`` to a file and runs it as N loopback MultiWorkerMirroredStrategy workers; the
    worker script can ``import keras_scale`` and read ``TF_CONFIG``. Raises with every worker's stderr tail
    if one fails.
    """

    def run(script_text, num_workers=2, args=(), timeout_s=300, check=True, env=None):
        script = tmp_path / f"worker_{abs(hash(script_text)) % 10**8}.py"
        script.write_text(script_text)
        worker_env = _worker_env(env)
        return launch_local_workers(
            [sys.executable, str(script), *map(str, args)], num_workers=num_workers, timeout_s=timeout_s,
            env=worker_env, cwd=str(tmp_path), check=check,
        )

    return run
