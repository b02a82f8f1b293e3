"""ReduceLROnPlateau with schedules and LearningRateLogger: Keras semantics, any LR, one point per update."""
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_scale as ks
from keras_scale.callbacks.lr_logger import current_learning_rate


def _model(optimizer, strategy=None):
    scope = strategy.scope() if strategy is not None else tf.name_scope("m")
    with scope:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=optimizer() if callable(optimizer) else optimizer, loss="mse", metrics=["mae"])
    return model


def _data(n=64, nan_row=None):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    if nan_row is not None:
        x[nan_row] = np.nan
    return x, y


def _drive(callback, model, values, monitor="val_loss"):
    """Run ``callback``'s epoch hooks over a given sequence of monitored values; the LR after each epoch."""
    callback.set_model(model)
    callback.on_train_begin()
    lrs = []
    for epoch, value in enumerate(values):
        callback.on_epoch_end(epoch, {monitor: value})
        lrs.append(current_learning_rate(model.optimizer))
    return lrs


# ---- ReduceLROnPlateau ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [dict(factor=0.5, patience=2),
                                    dict(factor=0.5, patience=1, cooldown=2, min_delta=0.05),
                                    dict(factor=0.1, patience=1, min_lr=0.002),
                                    dict(factor=0.5, patience=2, mode="max", monitor="val_acc")])
def test_plateau_follows_keras_semantics_on_a_constant_lr(kwargs):
    values = [1.0, 0.9, 0.9, 0.95, 0.89, 0.88, 0.88, 0.88, 0.7, 0.7, 0.7, 0.7, 0.7]
    monitor = kwargs.get("monitor", "val_loss")
    ours = _drive(ks.ReduceLROnPlateau(**kwargs), _model(keras.optimizers.SGD(0.1)), values, monitor)
    theirs = _drive(keras.callbacks.ReduceLROnPlateau(**kwargs), _model(keras.optimizers.SGD(0.1)), values,
                    monitor)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    assert ours[-1] < 0.1  # the sequence does trigger reductions


def test_plateau_lowers_a_warmup_cosine_where_keras_cannot():
    x, y = _data()
    schedule = ks.WarmupCosine(0.1, total_steps=100, warmup_steps=4)
    model = _model(keras.optimizers.SGD(schedule))
    with pytest.raises(TypeError, match="not settable"):
        _drive(keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=0, min_delta=1e9), model, [1.0, 1.0],
               "loss")
    # min_delta=1e9: only the first epoch counts as an improvement, so each later epoch (patience 1) halves the LR
    reducer = ks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1, min_delta=1e9)
    history = model.fit(x, y, batch_size=16, epochs=4, verbose=0, callbacks=[reducer])
    assert reducer.reductions == 3
    step = int(model.optimizer.iterations.numpy())
    assert current_learning_rate(model.optimizer) == pytest.approx(float(ks.WarmupCosine(0.1, 100, 4)(step)) / 8,
                                                                   rel=1e-5)
    assert history.history["learning_rate"][-1] == pytest.approx(current_learning_rate(model.optimizer), rel=1e-6)


def test_plateau_wraps_any_keras_schedule_and_training_uses_the_lower_lr():
    x, y = _data()
    schedule = keras.optimizers.schedules.CosineDecay(0.1, decay_steps=100)
    model = _model(keras.optimizers.SGD(schedule))
    reducer = ks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1, min_delta=1e9)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[reducer])
    assert reducer.reductions == 1
    # the next update moves the weights by the halved LR: SGD without momentum, update = lr * gradient
    before = [w.numpy() for w in model.trainable_weights]
    step = int(model.optimizer.iterations.numpy())
    with tf.GradientTape() as tape:
        loss = keras.losses.mean_squared_error(y[:16], model(x[:16]))
        loss = tf.reduce_mean(loss)
    grads = tape.gradient(loss, model.trainable_weights)
    model.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0, shuffle=False)
    expected_lr = float(schedule(step)) * 0.5
    for b, g, w in zip(before, grads, model.trainable_weights):
        np.testing.assert_allclose(w.numpy(), b - expected_lr * g.numpy(), rtol=1e-4, atol=1e-6)


def test_plateau_bad_arguments_and_missing_monitor():
    with pytest.raises(ValueError, match="factor"):
        ks.ReduceLROnPlateau(factor=1.5)
    with pytest.raises(ValueError, match="mode"):
        ks.ReduceLROnPlateau(mode="up")
    with pytest.raises(ValueError, match="patience"):
        ks.ReduceLROnPlateau(patience=-1)
    model = _model(keras.optimizers.SGD(0.1))
    with pytest.warns(UserWarning, match="val_loss.*available: loss"):
        assert _drive(ks.ReduceLROnPlateau(), model, [1.0], monitor="loss") == [pytest.approx(0.1)]


# ---- LearningRateLogger --------------------------------------------------------------------------------------

def _logged(log_dir, tag="optimizer/learning_rate"):
    """(step, value) of every point of ``tag`` in the event files under ``log_dir``."""
    points = []
    for root, _, files in sorted(os.walk(log_dir)):
        for name in sorted(f for f in files if f.startswith("events.out.tfevents")):
            path = os.path.join(root, name)
            points += [(e.step, float(tf.make_ndarray(v.tensor)))
                       for e in tf.compat.v1.train.summary_iterator(path) for v in e.summary.value if v.tag == tag]
    return points


def test_lr_logger_has_no_batch_hooks():
    # the point of the design: nothing runs on the training thread per step (see benchmarks/lr_logger_overhead.py)
    for hook in ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end"):
        assert getattr(ks.LearningRateLogger, hook) is getattr(keras.callbacks.Callback, hook), hook


def test_lr_logger_one_point_per_applied_update_with_skipped_steps(tmp_path):
    x, y = _data(nan_row=20)  # batch 1 of each epoch holds a NaN: NanGuard skips it, no update applied
    schedule = ks.WarmupCosine(0.05, total_steps=20, warmup_steps=5)
    model = _model(keras.optimizers.SGD(schedule))
    logger = ks.LearningRateLogger(str(tmp_path))
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False,
              callbacks=[ks.NanGuard(verbose=0), logger])
    points = _logged(str(tmp_path))
    updates = int(model.optimizer.iterations.numpy())
    assert updates == 6  # 2 epochs x (4 batches - 1 skipped)
    assert [s for s, _ in points] == list(range(updates))  # each update once, no duplicate at a skipped step
    for step, value in points:
        assert value == pytest.approx(float(schedule(step)), rel=1e-5)


def test_lr_logger_a_fit_in_a_loop_traces_nothing_new(tmp_path):
    # a model fitted in a loop with a fresh logger (and a fresh run directory) each time pays no trace per fit
    from keras_scale.callbacks import _scalars

    x, y = _data()
    model = _model(keras.optimizers.SGD(ks.WarmupCosine(0.05, total_steps=40, warmup_steps=4)))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[ks.LearningRateLogger(str(tmp_path / "r0"))])
    traced = _scalars._series_fn().experimental_get_tracing_count()
    for run in range(1, 3):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0,
                  callbacks=[ks.LearningRateLogger(str(tmp_path / f"r{run}"))])
    assert _scalars._series_fn().experimental_get_tracing_count() == traced
    for run in range(3):  # and every run holds its own updates' points
        assert [s for s, _ in _logged(str(tmp_path / f"r{run}"))] == list(range(4 * run, 4 * run + 4))


def test_lr_logger_every_n_steps_momentum_weight_decay_and_plateau_order(tmp_path):
    x, y = _data()
    schedule = ks.WarmupCosine(0.05, total_steps=40, warmup_steps=4)
    model = _model(keras.optimizers.AdamW(schedule, weight_decay=0.01, beta_1=0.8))
    # the reducer runs BEFORE the logger at each epoch end: the epoch's points keep the LR the epoch used
    reducer = ks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1, min_delta=1e9)
    logger = ks.LearningRateLogger(str(tmp_path), every_n_steps=3, log_momentum=True, log_weight_decay=True)
    model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[reducer, logger])
    points = _logged(str(tmp_path))
    assert [s for s, _ in points] == [0, 3, 6, 9]
    multiplier = {0: 1.0, 1: 1.0, 2: 0.5}  # epoch 1's reduction applies from epoch 2 (steps 8..11)
    for step, value in points:
        assert value == pytest.approx(float(ks.WarmupCosine(0.05, 40, 4)(step)) * multiplier[step // 4], rel=1e-5)
    assert [v for _, v in _logged(str(tmp_path), "optimizer/momentum")] == pytest.approx([0.8] * 4)
    assert [v for _, v in _logged(str(tmp_path), "optimizer/weight_decay")] == pytest.approx([0.01] * 4)


def test_lr_logger_constant_lr_under_mirrored_strategy(tmp_path, mirrored):
    x, y = _data()
    model = _model(lambda: keras.optimizers.SGD(0.02, momentum=0.9), strategy=mirrored)
    logger = ks.LearningRateLogger(str(tmp_path), log_momentum=True)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[logger])
    points = _logged(str(tmp_path))
    assert [s for s, _ in points] == list(range(8))
    assert [v for _, v in points] == pytest.approx([0.02] * 8)
    reducer = ks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1, min_delta=1e9)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[reducer])
    assert current_learning_rate(model.optimizer) == pytest.approx(0.01)


@pytest.mark.parametrize("schedule", [keras.optimizers.schedules.CosineDecay(0.1, decay_steps=10),
                                      keras.optimizers.schedules.PiecewiseConstantDecay([3, 6], [0.1, 0.05, 0.01])])
def test_lr_logger_evaluates_any_keras_schedule_per_update(tmp_path, schedule):
    x, y = _data()
    model = _model(keras.optimizers.SGD(schedule))
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[ks.LearningRateLogger(str(tmp_path))])
    points = _logged(str(tmp_path))
    assert [s for s, _ in points] == list(range(8))
    assert [v for _, v in points] == pytest.approx([float(schedule(s)) for s in range(8)], rel=1e-5)


def test_lr_logger_float_lr_with_the_reducer_listed_first(tmp_path):
    """A float LR lowered at an epoch's end by a callback listed before the logger: the epoch keeps its own LR."""
    x, y = _data()
    model = _model(keras.optimizers.SGD(0.1))
    reducer = ks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=1e9)
    model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[reducer, ks.LearningRateLogger(str(tmp_path))])
    points = _logged(str(tmp_path))
    assert [s for s, _ in points] == list(range(12))
    lr_of_epoch = {0: 0.1, 1: 0.1, 2: 0.05}  # reduced at epoch 1's end (epoch 0 improves on inf): from epoch 2 on
    for step, value in points:
        assert value == pytest.approx(lr_of_epoch[step // 4], rel=1e-6)
