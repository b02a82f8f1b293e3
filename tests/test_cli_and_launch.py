import subprocess
import sys


from keras_scale.launch import launch_local_workers, make_tf_config


def test_version_command_runs_as_module():
    out = subprocess.run([sys.executable, "-m", "keras_scale", "version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "keras_scale 0.1.0" in out.stdout and "tensorflow" in out.stdout


def test_unknown_command_fails_with_usage():
    out = subprocess.run([sys.executable, "-m", "keras_scale", "nope"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unknown command" in out.stderr


def test_launch_sets_distinct_tf_config_per_worker():
    code = "import json, os; c = json.loads(os.environ['TF_CONFIG']); print(c['task']['index'], len(c['cluster']['worker']))"
    results = launch_local_workers([sys.executable, "-c", code], num_workers=3, timeout_s=60, check=True)
    assert sorted(r.stdout.strip() for r in results) == ["0 3", "1 3", "2 3"]
    assert make_tf_config([1, 2], 1)["task"] == {"type": "worker", "index": 1}


def test_launch_kills_the_rest_when_one_worker_dies():
    code = "import os, sys, time; c = os.environ['TF_CONFIG']; sys.exit(3) if '\"index\": 1' in c else time.sleep(600)"
    results = launch_local_workers([sys.executable, "-c", code], num_workers=2, timeout_s=120, grace_s=1)
    assert results[1].returncode == 3
    assert results[0].returncode != 0  # killed, not left hanging for 600 s
