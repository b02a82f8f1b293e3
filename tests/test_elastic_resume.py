"""``ks.fit(elastic="scale_lr")`` across restarts: a second resume on the same fewer replicas keeps the global
batch and learning rate the first resume chose."""
import pytest


def test_a_second_resume_on_the_same_fewer_replicas_keeps_what_scale_lr_chose(tmp_path, capsys):
    # a run written on 2 replicas with global batch 6, resumed on 1 with elastic="scale_lr" (global 3, lr x 1/2),
    # then restarted once more on 1 replica: the math must not jump back to global batch 6 at the full rate
    import json as _json
    import warnings

    import keras
    import numpy as np

    import keras_scale as ks
    from keras_scale.elastic import record_path

    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    x = np.random.default_rng(0).random((24, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    ckpt = str(tmp_path / "ckpt")
    common = dict(global_batch_size=6, strategy="default", checkpoint_dir=ckpt, verbose=0, default_callbacks=False)
    ks.fit(build, x, y, epochs=1, **common)
    with open(record_path(ckpt), "w") as f:  # as if written by 2 replicas
        _json.dump({"global_batch_size": 6, "replicas": 2, "micro_batch_size": 3}, f)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = ks.fit(build, x, y, epochs=2, elastic="scale_lr", **common)
        second = ks.fit(build, x, y, epochs=3, elastic="scale_lr", **common)
    assert float(first.model.optimizer.learning_rate.numpy()) == pytest.approx(0.05)
    assert float(second.model.optimizer.learning_rate.numpy()) == pytest.approx(0.05)
    assert first.model.optimizer.iterations.numpy() == 4 + 8  # epoch 2 at global batch 3: 8 steps
    assert second.model.optimizer.iterations.numpy() == 4 + 8 + 8  # epoch 3 still at global batch 3
