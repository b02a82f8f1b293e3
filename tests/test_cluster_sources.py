"""Which cluster source wins when several are set (TF_CONFIG, a Slurm job step): a TF_CONFIG naming no cluster
does not shadow the Slurm step, for the strategy, the plan and is_chief alike; the doctor says which source wins."""
import sys

import pytest


SLURM_STEP = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "node[1-2]",
              "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}


def test_a_tf_config_naming_no_cluster_does_not_shadow_the_slurm_step_the_plan_and_is_chief_use(monkeypatch):
    # before: strategy_plan and is_chief read the Slurm step (task 1 of 2) while choose_strategy built the strategy
    # from the TF_CONFIG that names no cluster: every task trained alone, silently
    import keras_scale.distribute as dist

    for key, value in SLURM_STEP.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TF_CONFIG", '{"task": {"type": "worker", "index": 0}}')
    built = {}

    class Built(Exception):
        pass

    def multi_worker(all_reduce, config):  # what choose_strategy would build MultiWorkerMirroredStrategy from
        built["config"] = config
        raise Built

    monkeypatch.setattr(dist, "_multi_worker", multi_worker)
    assert dist.strategy_plan("auto")[0] == "multi_worker" and dist.is_chief() is False
    with pytest.raises(Built):
        dist.choose_strategy()
    assert built["config"] == {"cluster": {"worker": ["node1:8888", "node2:8888"]},
                               "task": {"type": "worker", "index": 1}}


def test_doctor_says_which_cluster_source_wins_when_tf_config_and_slurm_are_both_set():
    import keras_scale.doctor as _doctor  # noqa: F401
    dr = sys.modules["keras_scale.doctor"]
    ignored = dr.check_tf_config(dr.Facts(env={**SLURM_STEP, "TF_CONFIG": '{"task": {"type": "worker"}}'}))
    assert ignored.status == "warn" and "Slurm job step: task 1 of 2" in ignored.detail
    assert "names no cluster" in ignored.detail and "ignored" in ignored.detail
    broken = dr.check_tf_config(dr.Facts(env={**SLURM_STEP, "TF_CONFIG": "{not json"}))
    assert broken.status == "error" and "Unset TF_CONFIG to use a Slurm job step with 2 tasks" in broken.fix
    tf_config = '{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 0}}'
    wins = dr.check_tf_config(dr.Facts(env={**SLURM_STEP, "TF_CONFIG": tf_config}), resolve=lambda h: ["127.0.0.1"],
                              port_free=lambda h, p: True)
    assert wins.status == "warn" and "TF_CONFIG wins over a Slurm job step with 2 tasks" in wins.detail
    alone = dr.check_tf_config(dr.Facts(env={"TF_CONFIG": tf_config}), resolve=lambda h: ["127.0.0.1"],
                               port_free=lambda h, p: True)
    assert alone.status == "ok"
