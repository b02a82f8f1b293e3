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
