"""Strategy choice, chief identity and the Keras multi-worker fix (keras_scale.distribute)."""
import inspect

import keras
import pytest
import tensorflow as tf

from keras_scale import distribute as ksd


# --- the Keras multi-worker fix ------------------------------------------------------------------------------

def test_keras_internals_the_multi_worker_fix_touches_are_unchanged():
    """Fails loudly when a new Keras moves or fixes the code `patch_keras_multi_worker` wraps.

    If this fails: read keras/src/backend/tensorflow/trainer.py (`_maybe_symbolic_build`, `reduce_per_replica`),
    check whether keras-team/keras#20585 is fixed, and update (or drop) the patch and its fingerprints.
    """
    report = ksd.keras_internals_report()
    assert report["missing"] == [], f"Keras {keras.__version__} lost internals the fix needs: {report}"
    assert report["changed"] == [], f"Keras {keras.__version__} changed the code the fix wraps: {report}"
    assert ksd._KERAS_PATCH_MIN <= ksd._keras_version(), keras.__version__
    assert ksd._keras_version() <= ksd._KERAS_PATCH_TESTED_MAX, (
        f"Keras {keras.__version__} is newer than the version the multi-worker fix was verified on "
        f"({ksd._KERAS_PATCH_TESTED_MAX}); run tests/test_multi_worker.py and raise _KERAS_PATCH_TESTED_MAX."
    )


def test_patch_is_idempotent_and_wraps_only_two_functions():
    from keras.src.backend.tensorflow import trainer as tf_trainer

    assert ksd.patch_keras_multi_worker() is True
    reduce_fn = tf_trainer.reduce_per_replica
    build_fn = tf_trainer.TensorFlowTrainer._maybe_symbolic_build
    assert ksd.patch_keras_multi_worker() is True
    assert tf_trainer.reduce_per_replica is reduce_fn  # not wrapped twice
    assert tf_trainer.TensorFlowTrainer._maybe_symbolic_build is build_fn
    # the wrappers keep the originals reachable (and their Keras source for the fingerprint check)
    assert "axis=0" in inspect.getsource(reduce_fn.__wrapped__)


def test_patch_leaves_single_process_reduction_unchanged(mirrored):
    ksd.patch_keras_multi_worker()
    from keras.src.backend.tensorflow import trainer as tf_trainer

    values = mirrored.run(lambda: tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32))
    out = tf_trainer.reduce_per_replica({"m": values}, mirrored, reduction="auto")
    assert float(out["m"]) == pytest.approx(0.5)  # mean over the 2 replicas, as before
    concat = tf_trainer.reduce_per_replica(values, mirrored, reduction="concat")
    assert concat.numpy().tolist() == [0.0, 1.0]


# --- strategy choice -----------------------------------------------------------------------------------------

TWO_WORKERS = '{"cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]}, "task": {"type": "worker", "index": 1}}'
SLURM = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "gpu[07-08]",
         "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}


@pytest.mark.parametrize(
    "environ, num_gpus, kind, reason",
    [
        ({"TF_CONFIG": TWO_WORKERS}, 0, "multi_worker", "TF_CONFIG names a cluster of 2 workers"),
        ({"TF_CONFIG": TWO_WORKERS, **SLURM}, 8, "multi_worker", "TF_CONFIG"),  # TF_CONFIG wins
        (SLURM, 4, "multi_worker", "Slurm job step with 2 tasks"),
        ({**SLURM, "SLURM_STEP_NUM_TASKS": "1"}, 4, "mirrored", "4 local GPUs"),  # one task: local GPUs decide
        ({}, 2, "mirrored", "2 local GPUs"),
        ({}, 1, "default", "1 GPU"),
        ({}, 0, "default", "0 GPUs"),
        ({"TF_CONFIG": ""}, 0, "default", "no TF_CONFIG"),
    ],
)
def test_auto_strategy_choice_per_environment(environ, num_gpus, kind, reason):
    got_kind, got_reason = ksd.strategy_plan("auto", environ=environ, num_gpus=num_gpus)
    assert got_kind == kind and reason in got_reason


def test_strategy_names_objects_and_bad_input(mirrored):
    assert ksd.strategy_plan("mirrored", environ={}) == ("mirrored", "requested")
    assert ksd.choose_strategy(mirrored) is mirrored
    assert ksd.choose_strategy("default") is tf.distribute.get_strategy()
    with pytest.raises(ValueError, match="unknown strategy 'horovod'"):
        ksd.choose_strategy("horovod")
    with pytest.raises(TypeError, match="tf.distribute.Strategy"):
        ksd.choose_strategy(3)
    with pytest.raises(ValueError, match="cannot change a strategy object"):
        ksd.choose_strategy(mirrored, all_reduce="nccl")
    with pytest.raises(ValueError, match="unknown all_reduce 'gloo'"):
        ksd.choose_strategy("auto", all_reduce="gloo")
    with pytest.raises(ValueError, match="TF_CONFIG is not valid JSON"):
        ksd.strategy_plan("auto", environ={"TF_CONFIG": "{oops"})


def test_multi_worker_by_name_without_a_cluster_says_what_to_set(monkeypatch):
    for var in ("TF_CONFIG", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="needs a cluster: set TF_CONFIG"):
        ksd.choose_strategy("multi_worker")


def test_slurm_variables_become_tf_config():
    assert ksd.slurm_tf_config(SLURM) == {
        "cluster": {"worker": ["gpu07:8888", "gpu08:8888"]}, "task": {"type": "worker", "index": 1}}
    two_per_node = {"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NODELIST": "n[1-2]",
                    "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    assert ksd.slurm_tf_config(two_per_node, port_base=9000) == {
        "cluster": {"worker": ["n1:9000", "n1:9001", "n2:9000", "n2:9001"]}, "task": {"type": "worker", "index": 2}}
    assert ksd.slurm_tf_config({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}) is None  # not multi-worker
    assert ksd.slurm_tf_config({}) is None
    assert "SLURM_PROCID" not in __import__("os").environ  # the resolver's view of os.environ was restored


def test_all_reduce_falls_back_when_the_first_choice_fails_and_says_why(caplog):
    # NCCL has no CPU kernel: a real failure of the collective, caught by the probe
    with caplog.at_level("WARNING", logger="keras_scale"):
        strategy = ksd.mirrored_with_fallback(["/cpu:0", "/cpu:1"], candidates=("nccl", "one_device"))
    assert strategy._keras_scale_all_reduce == "one_device"
    assert "all-reduce with nccl failed" in caplog.text and "NcclAllReduce" in caplog.text
    total = strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
    assert float(total) == 2.0


def test_explicit_all_reduce_that_fails_raises_with_the_fix():
    with pytest.raises(RuntimeError, match="Try all_reduce='one_device'"):
        ksd.mirrored_with_fallback(["/cpu:0", "/cpu:1"], candidates=("nccl",))
    strategy = ksd.choose_strategy("mirrored", all_reduce="hierarchical_copy", devices=["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2 and strategy._keras_scale_all_reduce == "hierarchical_copy"


def test_a_device_the_process_does_not_have_is_refused_not_waited_on():
    # TensorFlow's all-reduce probe blocks forever on a device that does not exist: refuse it up front
    with pytest.raises(ValueError, match=r"/cpu:7.*do not exist.*set_logical_device_configuration"):
        ksd.mirrored_with_fallback(["/cpu:0", "/cpu:7"])
    assert ksd.mirrored_with_fallback(["/cpu:0"]).num_replicas_in_sync == 1


@pytest.mark.skipif(not tf.config.list_physical_devices("GPU"), reason="needs a GPU")
def test_memory_growth_on_every_gpu():
    gpus = tf.config.list_physical_devices("GPU")
    assert ksd.enable_memory_growth() == len(gpus)
    assert all(tf.config.experimental.get_memory_growth(g) for g in gpus)


# --- chief identity ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "config, chief",
    [
        (None, True),
        ({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0}}, True),
        ({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}}, False),
        ({"cluster": {"chief": ["c:1"], "worker": ["a:1"]}, "task": {"type": "worker", "index": 0}}, False),
        ({"cluster": {"chief": ["c:1"], "worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}, True),
    ],
)
def test_is_chief_follows_tf_config(monkeypatch, config, chief):
    import json

    if config is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    assert ksd.is_chief() is chief
