"""The cluster templates in examples/: what the scheduler is told, and their start-up logic run on loopback workers
with the environment the scheduler would set (Slurm's task variables; a Kubernetes pod's index and hostname).

- the Slurm batch script signals USR1 120 s before the limit, asks for requeue, runs one task per node, and
  requeues the job exactly when the step exits 42; its workers, started with Slurm's variables only, form one
  cluster (chief = task 0), exit 42 after SIGUSR1 with their state saved, and the requeued run finishes;
- the Kubernetes Indexed Job restarts (Ignores) exit 42 without counting it; pods started with the Job's
  environment (JOB_COMPLETION_INDEX, hostname <job>-<index>) form one cluster and train.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from keras_scale.distribute import cluster_task, is_chief, kubernetes_tf_config, strategy_plan

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "examples" / "slurm" / "train.sbatch"
MANIFEST = REPO / "examples" / "kubernetes" / "train-job.yaml"
TRAIN = REPO / "examples" / "train_resumable.py"


def _free_consecutive_ports(n=2):
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        socks = []
        try:
            for i in range(n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    pytest.skip("no consecutive free ports")


def _base_env(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG" and not k.startswith("SLURM_")}
    env.update(PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0",
               PYTHONUNBUFFERED="1")
    return env


def _start(cmd, envs, cwd):
    return [subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True) for env in envs]


def _finish(procs, timeout_s=400):
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout_s)
            out.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return out


def _reports(outputs):
    return [json.loads([ln for ln in stdout.splitlines() if ln.startswith("{")][-1]) for _, stdout, _ in outputs]


# ------------------------------------------------------------------------------------------------------- Slurm
def _sbatch_options():
    return [ln.split(None, 1)[1].strip() for ln in SBATCH.read_text().splitlines() if ln.startswith("#SBATCH ")]


def test_slurm_script_asks_for_the_signal_requeue_and_one_task_per_node():
    options = _sbatch_options()
    assert "--signal=USR1@120" in options and "--requeue" in options and "--ntasks-per-node=1" in options
    srun = [ln for ln in SBATCH.read_text().splitlines() if ln.startswith("srun ")]
    assert len(srun) == 1 and "--ntasks-per-node=1" in srun[0]


@pytest.mark.parametrize("status, requeued", [(42, True), (0, False), (1, False), (137, False)])
def test_slurm_script_requeues_exactly_on_exit_42(tmp_path, status, requeued):
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "srun").write_text('#!/bin/bash\necho "$@" > "$STUB_LOG/srun"\nexit "$STUB_STATUS"\n')
    (stubs / "scontrol").write_text('#!/bin/bash\necho "$@" >> "$STUB_LOG/scontrol"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = dict(os.environ, PATH=f"{stubs}{os.pathsep}{os.environ['PATH']}", STUB_LOG=str(tmp_path),
               STUB_STATUS=str(status), SLURM_JOB_ID="4242", SLURM_JOB_NAME="t")
    proc = subprocess.run(["bash", str(SBATCH), "--epochs", "5"], cwd=str(tmp_path), env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == status
    srun_args = (tmp_path / "srun").read_text().split()
    assert srun_args[:1] == ["--ntasks-per-node=1"] and "examples/train_resumable.py" in srun_args
    assert srun_args[-2:] == ["--epochs", "5"]  # the script's arguments reach the workers
    scontrol = tmp_path / "scontrol"
    assert (scontrol.read_text().split() if scontrol.exists() else []) == (["requeue", "4242"] if requeued else [])


def test_is_chief_is_right_under_slurm_before_a_strategy_exists(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.setenv("SLURM_PROCID", "1")
    assert cluster_task() == ("Slurm", "worker", 1, 2)
    assert not is_chief()
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert is_chief()
    assert strategy_plan("auto", num_gpus=0) == ("multi_worker", "Slurm job step with 2 tasks")


def _slurm_envs(tmp_path, port_base, n=2):
    envs = []
    for i in range(n):
        env = _base_env(tmp_path)
        # `srun --ntasks-per-node=1` on 2 nodes, here both "nodes" are this machine (one port per task)
        env.update(SLURM_PROCID=str(i), SLURM_STEP_NUM_TASKS=str(n), SLURM_STEP_NODELIST="localhost",
                   SLURM_STEP_TASKS_PER_NODE=str(n), SLURM_JOB_ID="77", KERAS_SCALE_PORT_BASE=str(port_base),
                   KERAS_SCALE_HEARTBEAT_FILE=str(tmp_path / f"beat-{i}.json"))
        envs.append(env)
    return envs


@pytest.mark.slow
def test_slurm_workers_save_and_exit_42_on_usr1_and_the_requeued_run_finishes(tmp_path):
    cmd = [sys.executable, str(TRAIN), "--checkpoint-dir", str(tmp_path / "ckpt"), "--epochs", "3",
           "--step-delay-s", "0.05"]
    procs = _start(cmd, _slurm_envs(tmp_path, _free_consecutive_ports()), str(tmp_path))
    deadline = time.monotonic() + 300
    from keras_scale.heartbeat_file import read_heartbeat

    while time.monotonic() < deadline and not all(
            (read_heartbeat(str(tmp_path / f"beat-{i}.json")) or {}).get("phase") == "step" for i in range(2)):
        assert all(p.poll() is None for p in procs), _finish(procs)
        time.sleep(0.2)
    for p in procs:  # what --signal=USR1@120 does: every task gets SIGUSR1
        os.kill(p.pid, signal.SIGUSR1)
    outputs = _finish(procs)
    assert [code for code, _, _ in outputs] == [42, 42], [err[-2000:] for _, _, err in outputs]
    # requeued: the same command with the same variables resumes and finishes
    outputs = _finish(_start(cmd, _slurm_envs(tmp_path, _free_consecutive_ports()), str(tmp_path)))
    assert [code for code, _, _ in outputs] == [0, 0], [err[-2000:] for _, _, err in outputs]
    reports = _reports(outputs)
    assert [(r["source"], r["index"], r["chief"], r["replicas"]) for r in reports] == [
        ("Slurm", 0, True, 2), ("Slurm", 1, False, 2)]
    # resumed where the preemption saved: fewer steps in this run, the full 3 epochs x 16 steps in all
    assert [r["global_step"] for r in reports] == [48, 48]
    assert 0 < reports[0]["steps_this_run"] < 48, reports


# -------------------------------------------------------------------------------------------------- Kubernetes
def _manifest():
    text = MANIFEST.read_text()
    env = dict(re.findall(r"- name: (\S+)\n\s+value: \"(.*)\"", text))
    command = json.loads(re.search(r"command: (\[.*\])", text).group(1))
    return text, env, command


def test_kubernetes_job_is_indexed_and_restarts_exit_42_without_counting_it():
    text, env, _ = _manifest()
    assert "completionMode: Indexed" in text and "restartPolicy: Never" in text
    completions = int(re.search(r"completions: (\d+)", text).group(1))
    assert int(env["KERAS_SCALE_NUM_WORKERS"]) == completions == int(re.search(r"parallelism: (\d+)", text).group(1))
    assert re.search(r"- action: Ignore\n\s+onExitCodes:\n\s+containerName: trainer\n\s+operator: In\n"
                     r"\s+values: \[42\]", text)
    assert re.search(r"subdomain: (\S+)", text).group(1) == env["KERAS_SCALE_K8S_SUBDOMAIN"] == \
        re.search(r"kind: Service\nmetadata:\n\s+name: (\S+)", text).group(1)
    # pod 1 of the Job, as Kubernetes starts it: its TF_CONFIG names every pod through the headless Service
    pod = dict(env, JOB_COMPLETION_INDEX="1", HOSTNAME="keras-scale-train-1")
    assert kubernetes_tf_config(pod) == {
        "cluster": {"worker": ["keras-scale-train-0.keras-scale-train:8888", "keras-scale-train-1.keras-scale-train:8888"]},
        "task": {"type": "worker", "index": 1}}
    assert cluster_task(pod) == ("Kubernetes", "worker", 1, 2)


@pytest.mark.slow
def test_kubernetes_pods_started_with_the_jobs_environment_train_as_one_cluster(tmp_path):
    _, manifest_env, command = _manifest()
    port_base = _free_consecutive_ports()
    envs = []
    for i in range(int(manifest_env["KERAS_SCALE_NUM_WORKERS"])):
        env = _base_env(tmp_path)
        env.update(manifest_env)
        # what Kubernetes sets in pod i of the Indexed Job; the Service's DNS names become loopback ports here
        env.update(JOB_COMPLETION_INDEX=str(i), HOSTNAME=f"keras-scale-train-{i}", KERAS_SCALE_PORT_BASE=str(port_base),
                   KERAS_SCALE_WORKER_ADDRESS="127.0.0.1:{index_port}")
        envs.append(env)
    cmd = [sys.executable if command[0] == "python" else command[0], str(REPO / command[1]), command[2],
           str(tmp_path / "ckpt"), "--epochs", "1"]
    outputs = _finish(_start(cmd, envs, str(tmp_path)))
    assert [code for code, _, _ in outputs] == [0, 0], [err[-2000:] for _, _, err in outputs]
    reports = _reports(outputs)
    assert [(r["source"], r["index"], r["chief"], r["replicas"]) for r in reports] == [
        ("Kubernetes", 0, True, 2), ("Kubernetes", 1, False, 2)]
