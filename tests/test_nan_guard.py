"""NanGuard: non-finite steps never reach the weights; the user is told why."""
import numpy as np
import pytest
import keras
import tensorflow as tf

import keras_scale as ks
from keras_scale.callbacks.nan_guard import NanGuardGaveUp
from tests._helpers import linspace_mlp

BATCH = 16


def _data(n=128, d=6, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype("float32")
    w = rng.normal(size=(d, 1)).astype("float32")
    return x, (x @ w).astype("float32")


def _poison(x, batch_index, value=np.nan, count=3):
    x = x.copy()
    x[batch_index * BATCH: batch_index * BATCH + count, 0] = value
    return x


def _finite(model):
    return all(np.isfinite(w).all() for w in model.get_weights())


@pytest.mark.parametrize("accum", [None, 4])
def test_skip_nan_input_batch(accum):
    x, y = _data()
    x = _poison(x, batch_index=2)
    inner = linspace_mlp()
    model = ks.wrap(inner, accum=accum) if accum else inner
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    guard = ks.NanGuard(verbose=0)
    history = model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, shuffle=False, callbacks=[guard])
    assert _finite(inner)
    assert guard.skipped_steps == 3  # once per epoch, exactly
    assert history.history["nan_skipped"] == [1, 1, 1]
    assert np.isfinite(history.history["loss"]).all()  # the bad batch did not poison the logged loss
    assert int(model.optimizer.iterations.numpy()) == 3 * 8 - 3  # no iterations bump on a skipped step
    assert len(guard.reports) == 3
    report = guard.reports[0]
    assert report.source == "inputs" and "inputs[0]: 3 non-finite values" in report.details[0]
    assert "clean the data" in report.advice
    # a new guard on a later fit: skipped_steps is the model's count over its whole training, this fit's epochs in
    # nan_skipped
    again = ks.NanGuard(verbose=0)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False, callbacks=[again])
    assert again.skipped_steps == 5 and history.history["nan_skipped"] == [1, 1]


def test_skipped_step_is_exactly_a_no_op():
    """Training with a poisoned batch skipped == training on the data without that batch."""
    x, y = _data()
    bad = _poison(x, batch_index=3)
    guarded = linspace_mlp(bn=True)
    guarded.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    guarded.fit(bad, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[ks.NanGuard(verbose=0)])
    keep = np.r_[0:3 * BATCH, 4 * BATCH:len(x)]
    reference = linspace_mlp(bn=True)
    reference.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    reference.fit(x[keep], y[keep], batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    # weights, BatchNorm moving statistics and Adam moments all as if the batch never happened
    for a, b in zip(guarded.weights, reference.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
    for a, b in zip(guarded.optimizer.variables, reference.optimizer.variables):
        np.testing.assert_allclose(np.asarray(a.numpy()), np.asarray(b.numpy()), rtol=1e-5, atol=1e-6)


def test_stop_keeps_the_last_good_weights():
    x, y = _data()
    bad = _poison(x, batch_index=5)
    model = linspace_mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    guard = ks.NanGuard(policy="stop", verbose=0)
    model.fit(bad, y, batch_size=BATCH, epochs=3, verbose=0, shuffle=False, callbacks=[guard])
    reference = linspace_mlp()
    reference.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    reference.fit(x[:5 * BATCH], y[:5 * BATCH], batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    assert model.stop_training
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert int(model.optimizer.iterations.numpy()) == 5


def test_rollback_recovers_from_lr_explosion_and_converges():
    x, y = _data(n=256)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    # lr 3.0 diverges on this least-squares problem: weights blow up to inf within ~40 updates
    schedule = ks.WarmupCosine(peak_lr=3.0, total_steps=10_000, warmup_steps=0)
    model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse")
    guard = ks.NanGuard(policy="rollback", max_consecutive=2, lr_factor=0.1, snapshot_every_n_steps=4, verbose=0)
    history = model.fit(x, y, batch_size=BATCH, epochs=12, verbose=0, shuffle=False, callbacks=[guard])
    assert guard.rollbacks >= 1
    assert float(ks.schedules.lr_multiplier(model.optimizer).numpy()) == pytest.approx(0.1 ** guard.rollbacks)
    assert _finite(model)
    assert history.history["loss"][-1] < 1e-3  # converged after lowering the LR


def test_rollback_to_the_snapshot_keeps_earlier_lowering_of_a_float_lr():
    # two bad batches close together: both rollbacks restore the SAME in-memory snapshot (taken before the first);
    # the learning rate must end at lr * factor**2, not be reset to the snapshot's lr and lowered once
    x, y = _data(n=256)
    x = _poison(_poison(x, 6), 8)
    model = linspace_mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    guard = ks.NanGuard(policy="rollback", max_consecutive=1, lr_factor=0.5, snapshot_every_n_steps=5, verbose=0)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[guard])
    assert guard.rollbacks == 2 and _finite(model)
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.05 * 0.5 ** 2)


def test_rollback_restores_from_chief_checkpoint(tmp_path):
    x, y = _data(n=256)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(ks.WarmupCosine(3.0, total_steps=10_000)), loss="mse")
    ckpt = ks.ChiefCheckpoint(str(tmp_path / "ckpt"), save_freq=4, max_to_keep=2, verbose=0)
    guard = ks.NanGuard(policy="rollback", max_consecutive=2, lr_factor=0.1, verbose=0)
    history = model.fit(x, y, batch_size=BATCH, epochs=12, verbose=0, shuffle=False, callbacks=[ckpt, guard])
    assert guard.rollbacks >= 1 and guard._snapshot is None  # restored from the checkpoint, no in-memory copy
    assert guard.skipped_steps >= 2 and _finite(model)
    assert history.history["loss"][-1] < 1e-3


def test_rollback_gives_up_with_a_clear_error():
    x, y = _data()
    x[:] = np.nan  # every step is bad: nothing can help
    model = linspace_mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    guard = ks.NanGuard(policy="rollback", max_consecutive=1, max_rollbacks=2, verbose=0)
    with pytest.raises(NanGuardGaveUp, match="gave up after 2 rollbacks"):
        model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[guard])
    assert _finite(model)


def test_fp16_overflow_handled_by_loss_scaler_is_not_an_incident():
    x, y = _data()
    y = y * 100.0
    model = linspace_mlp()
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2.0 ** 127)
    model.compile(optimizer=opt, loss="mse")
    guard = ks.NanGuard(verbose=0)
    history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[guard])
    assert float(opt.dynamic_scale.numpy()) < 2.0 ** 127  # the scaler skipped and lowered its scale
    assert guard.skipped_steps == 0 and guard.reports == []
    assert np.isfinite(history.history["loss"]).all() and _finite(model)


def test_nan_loss_under_loss_scaling_is_an_incident_with_scale_state():
    x, y = _data()
    y = y.copy()
    y[2 * BATCH] = np.nan
    model = linspace_mlp()
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    guard = ks.NanGuard(verbose=0)
    history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[guard])
    assert guard.skipped_steps == 1
    assert guard.reports[0].source == "targets" and guard.reports[0].loss_scale is not None
    assert np.isfinite(history.history["loss"]).all() and _finite(model)


@pytest.mark.parametrize("accum", [None, 2])
def test_all_replicas_take_the_same_decision(mirrored, accum):
    x, y = _data()
    # poison only samples that land on replica 1 (the second half of batch 4)
    x = x.copy()
    x[4 * BATCH + BATCH - 2, 1] = np.inf
    with mirrored.scope():
        inner = linspace_mlp(bn=True)
        model = ks.wrap(inner, accum=accum) if accum else inner
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    guard = ks.NanGuard(verbose=0)
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False, callbacks=[guard])
    assert guard.skipped_steps == 2
    for v in inner.weights:  # every replica's copy is finite ...
        copies = [c.numpy() for c in mirrored.experimental_local_results(v.value)]
        assert all(np.isfinite(c).all() for c in copies)
        if v.trainable:  # ... and the trained weights identical (Keras 3 keeps BN moving stats per replica)
            np.testing.assert_array_equal(copies[0], copies[1])
    assert guard.reports[0].source == "inputs"


def test_gradient_source_is_reported():
    x, y = _data()

    class Exploding(keras.layers.Layer):
        def call(self, inputs):  # finite forward, infinite gradient at 0: d/dx sqrt(|x|)
            return tf.sqrt(tf.abs(inputs))

    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, kernel_initializer="zeros"),
                              Exploding(), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    guard = ks.NanGuard(verbose=0)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[guard])
    assert guard.reports and guard.reports[0].source == "gradients"
    assert any("kernel" in d for d in guard.reports[0].details)
    assert _finite(model)


@pytest.mark.parametrize("guard_first", [True, False])
def test_guard_is_switched_off_after_fit_and_its_count_reaches_tensorboard_in_one_tag(tmp_path, guard_first):
    x, y = _data()
    model = linspace_mlp()
    model.compile(optimizer="sgd", loss="mse")
    guard, board = ks.NanGuard(verbose=0, log_dir=str(tmp_path)), keras.callbacks.TensorBoard(str(tmp_path))
    model.fit(_poison(x, 1), y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False,
              callbacks=[guard, board] if guard_first else [board, guard])
    assert "train_step" not in vars(model) and "make_train_function" not in vars(model)  # plain Keras is back
    events = list((tmp_path / "train").glob("events.out.tfevents.*"))
    values = {}
    for path in events:
        for e in tf.compat.v1.train.summary_iterator(str(path)):
            for v in e.summary.value:
                values.setdefault(v.tag, []).append(int(tf.make_ndarray(v.tensor)) if "nan" in v.tag else 0)
    assert values["epoch_nan_skipped"] == [1, 1]  # the step's own per-epoch count, whatever the order
    assert [tag for tag in values if "nan" in tag] == ["epoch_nan_skipped"]  # NanGuard repeats it under no tag


@pytest.mark.parametrize(
    "kwargs", [dict(policy="ignore"), dict(max_consecutive=0), dict(lr_factor=0.0), dict(lr_factor=2.0),
               dict(max_rollbacks=-1), dict(snapshot_every_n_steps=0)])
def test_bad_input(kwargs):
    with pytest.raises(ValueError):
        ks.NanGuard(**kwargs)


@pytest.mark.parametrize("accum", [None, 4])
def test_composes_with_xla(accum):
    x, y = _data()
    inner = linspace_mlp()
    model = ks.wrap(inner, accum=accum) if accum else inner
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", jit_compile=True)
    guard = ks.NanGuard(verbose=0)
    model.fit(_poison(x, 3), y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False, callbacks=[guard])
    assert guard.skipped_steps == 2 and _finite(inner)
    assert guard.reports[0].source == "inputs"


class _Exploding(keras.layers.Layer):
    def call(self, inputs):  # finite forward, non-finite gradient at 0: d/dx sqrt(|x|)
        return tf.sqrt(tf.abs(inputs))


def _exploding_model(cls=keras.Sequential):
    model = cls([keras.Input((6,)), keras.layers.Dense(4, kernel_initializer="zeros"), _Exploding(),
                 keras.layers.Dense(1, kernel_initializer="ones")])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def test_loss_only_check_skips_a_non_finite_loss_step_like_the_default():
    x, y = _data()
    model = linspace_mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    guard = ks.NanGuard(verbose=0, check_gradients=False)
    history = model.fit(_poison(x, 2), y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False, callbacks=[guard])
    assert guard.skipped_steps == 2 and history.history["nan_skipped"] == [1, 1]
    assert _finite(model) and int(model.optimizer.iterations.numpy()) == 2 * 8 - 2
    assert np.isfinite(history.history["loss"]).all() and guard.reports[0].source == "inputs"


def test_loss_only_check_applies_a_finite_loss_with_non_finite_gradients_as_documented():
    x, y = _data()
    default, loss_only = _exploding_model(), _exploding_model()
    strict = ks.NanGuard(verbose=0)
    default.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[strict])
    assert _finite(default) and strict.reports[0].source == "gradients"
    assert int(default.optimizer.iterations.numpy()) == 0  # every step's gradient is non-finite: none applied

    lenient = ks.NanGuard(verbose=0, check_gradients=False)
    history = loss_only.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False, callbacks=[lenient])
    # the first step (finite loss) was applied with its non-finite gradients; the next steps' predictions are
    # non-finite: skipped, counted, and reported once as what they are (non-finite weights, not an overflowing
    # forward pass), not once more per step the poisoned state makes non-finite
    assert int(loss_only.optimizer.iterations.numpy()) == 1 and not _finite(loss_only)
    assert lenient.skipped_steps == 15 and history.history["nan_skipped"] == [7, 8]
    assert [r.source for r in lenient.reports] == ["weights"]


def test_any_guard_asking_for_the_gradient_check_gets_it_and_switching_reuses_traces():
    from keras_scale.step import get_step
    x, y = _data()
    model = _exploding_model()
    both = [ks.NanGuard(verbose=0, check_gradients=False), ks.NanGuard(verbose=0)]
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=both)
    assert _finite(model) and int(model.optimizer.iterations.numpy()) == 0
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[ks.NanGuard(verbose=0, check_gradients=False)])
    traces = get_step(model).traces
    for check in (True, False, True):
        model.fit(x[:32], y[:32], batch_size=BATCH, epochs=1, verbose=0,
                  callbacks=[ks.NanGuard(verbose=0, check_gradients=check)])
    assert get_step(model).traces == traces  # one trace per configuration, reused by later fits


def test_loss_only_check_on_a_model_with_its_own_train_step_still_checks_gradients():
    class Own(keras.Sequential):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            self.optimizer.apply(tape.gradient(loss, self.trainable_weights), self.trainable_weights)
            return {"loss": loss}

    x, y = _data()
    model = _exploding_model(Own)
    with pytest.warns(UserWarning, match="gradients are checked at the optimizer"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                  callbacks=[ks.NanGuard(verbose=0, check_gradients=False)])
    assert _finite(model) and int(model.optimizer.iterations.numpy()) == 0


def test_check_gradients_must_be_a_bool():
    with pytest.raises(TypeError, match="check_gradients must be True or False"):
        ks.NanGuard(check_gradients="yes")


# NanGuard(check_gradients=False) lets a finite-loss step with non-finite gradients through; what it must still
# guarantee: the poisoned state is reported as such, never saved, never snapshotted, never called good.
class _Norm(keras.layers.Layer):
    def call(self, inputs):  # finite for an all-zero row, but its gradient there is 0/0
        return tf.sqrt(tf.reduce_sum(inputs * inputs, axis=-1, keepdims=True))


def _norm_model():
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(4, use_bias=False, kernel_initializer="ones")(inputs)
    outputs = keras.layers.Add()([keras.layers.Dense(1, kernel_initializer="ones")(inputs), _Norm()(hidden)])
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=["mae"])
    return model


def _zero_row_data(batch_index=2):
    x, y = _data()
    x[batch_index * BATCH] = 0.0  # one all-zero row: finite loss, NaN gradient for the hidden kernel
    return x, y


def test_loss_only_never_saves_a_non_finite_state_and_rolls_back_to_a_finite_one(tmp_path):
    from keras_scale.callbacks.checkpoint import read_checkpoint
    x, y = _zero_row_data()
    model = _norm_model()
    guard = ks.NanGuard(verbose=0, check_gradients=False, policy="rollback")
    ckpt = ks.ChiefCheckpoint(str(tmp_path / "ckpt"), save_freq=1, verbose=0, max_to_keep=50)
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False, callbacks=[guard, ckpt])
    assert _finite(model) and guard.rollbacks == 2
    assert guard.reports[0].source == "weights" and "check_gradients" in guard.reports[0].advice
    assert any("dense" in d for d in guard.reports[0].details)
    prefixes = tf.train.get_checkpoint_state(str(tmp_path / "ckpt")).all_model_checkpoint_paths
    assert len(prefixes) > 5
    for prefix in prefixes:
        reader = read_checkpoint(prefix)
        for name in reader.get_variable_to_dtype_map():
            value = reader.get_tensor(name)
            if getattr(value, "dtype", None) is not None and np.issubdtype(value.dtype, np.floating):
                assert np.isfinite(value).all(), (prefix, name)


def test_loss_only_rollback_snapshot_skips_a_non_finite_state():
    x, y = _zero_row_data()
    model = _norm_model()
    guard = ks.NanGuard(verbose=0, check_gradients=False, policy="rollback", snapshot_every_n_steps=1)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[guard])
    assert _finite(model) and guard.rollbacks == 1


def test_loss_only_stop_says_the_weights_are_not_usable(capsys):
    x, y = _zero_row_data()
    model = _norm_model()
    guard = ks.NanGuard(verbose=1, check_gradients=False, policy="stop")
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[guard])
    err = capsys.readouterr().err
    assert not _finite(model) and "NOT usable" in err and "last good step" not in err


def test_loss_only_reports_a_non_finite_embedding_row_at_epoch_end():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 10, size=(128, 1))
    tokens[40] = 0  # the only use of token 0, whose row starts at zero: its norm's gradient is NaN
    inputs = keras.Input((1,), dtype="int32")
    emb = keras.layers.Embedding(10, 4, embeddings_initializer="ones", name="emb")
    vectors = keras.layers.Flatten()(emb(inputs))
    model = keras.Model(inputs, _Norm()(vectors))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    emb.embeddings.assign(np.concatenate([np.zeros((1, 4)), np.ones((9, 4))]).astype("float32"))
    guard = ks.NanGuard(verbose=0, check_gradients=False)
    model.fit(tokens, np.ones((128, 1)), batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[guard])
    assert guard.skipped_steps == 0  # no step's loss was ever non-finite ...
    assert guard.reports and guard.reports[-1].source == "weights"  # ... and yet it is not silent
    assert "emb" in " ".join(guard.reports[-1].details)


def test_loss_only_under_loss_scaling_still_checks_gradients():
    x, y = _data()
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        model = _exploding_model()
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
        guard = ks.NanGuard(verbose=0, check_gradients=False)
        model.fit(np.tile(x, (3, 1)), np.tile(y, (3, 1)), batch_size=BATCH, epochs=1, verbose=0, callbacks=[guard])
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    assert guard.reports and guard.reports[0].source == "gradients"  # the scale floor is still reported
    assert _finite(model)


class _Inject(keras.layers.Layer):
    """A weight the forward pass ignores, whose gradient is the batch sum of input column 0: an inf there gives a
    finite loss and a non-finite weight that never shows in the loss (the hardest case for a loss-only check)."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(1,), initializer="zeros", name="w")

    def call(self, inputs):
        @tf.custom_gradient
        def passthrough(w, x):
            return tf.zeros_like(x[:, :1]), lambda dy: (tf.reduce_sum(x[:, :1], axis=0), None)
        return passthrough(tf.convert_to_tensor(self.w), inputs)


def _inject_model():
    inputs = keras.Input((6,))
    features = keras.layers.Lambda(lambda t: t[:, 1:])(inputs)  # column 0 feeds the injected gradient only
    outputs = keras.layers.Add()([keras.layers.Dense(1)(features), _Inject(name="inj")(inputs)])
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=["mae"])
    return model


@pytest.mark.parametrize("guard_first", [True, False])
def test_loss_only_never_saves_a_non_finite_state_whatever_the_callback_order(tmp_path, guard_first):
    from keras_scale.callbacks.checkpoint import read_checkpoint
    x, y = _data()
    poisoned = x.copy()
    poisoned[2 * BATCH, 0] = np.inf  # epoch 2 (of the resumed run): finite loss, inj/w -> -inf, loss stays finite

    def callbacks():
        guard = ks.NanGuard(verbose=0, check_gradients=False)  # "skip": the state stays non-finite to the end
        ckpt = ks.ChiefCheckpoint(str(tmp_path), keep_best_k=2, monitor="loss")
        return [guard, ckpt] if guard_first else [ckpt, guard]

    model = _inject_model()
    first = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=callbacks())
    cbs = callbacks()
    model.fit(poisoned, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False, callbacks=cbs)
    guard, ckpt = cbs if guard_first else cbs[::-1]
    assert not _finite(model) and [r.source for r in guard.reports] == ["weights"]  # reported once, not twice
    state = tf.train.get_checkpoint_state(str(tmp_path))
    for prefix in state.all_model_checkpoint_paths:  # the epoch-end and the final save were refused
        reader = read_checkpoint(prefix)
        for name in reader.get_variable_to_dtype_map():
            value = np.asarray(reader.get_tensor(name))
            if np.issubdtype(value.dtype, np.floating):
                assert np.isfinite(value).all(), (prefix, name)
    # best/ holds epoch 0's checkpoint with its own score (a refused save's score is not given to an older file)
    assert len(ckpt.best_checkpoints) == 1
    assert ckpt.best_checkpoints[0][0] == pytest.approx(first.history["loss"][0])


def test_loss_only_rollback_leaves_no_non_finite_state_even_after_early_stopping_restores_one():
    x, y = _data()
    x[3 * BATCH, 0] = np.inf  # every epoch's batch 3: finite loss, inj/w -> -inf, the loss keeps improving
    model = _inject_model()
    early = keras.callbacks.EarlyStopping(monitor="loss", patience=5, restore_best_weights=True)
    guard = ks.NanGuard(verbose=0, check_gradients=False, policy="rollback", snapshot_every_n_steps=1)
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False, callbacks=[early, guard])
    # EarlyStopping's on_train_end (first in the list) put back weights it recorded before a rollback; the
    # guard's train-end check rolls back again
    assert _finite(model) and guard.rollbacks >= 2 and guard.reports[-1].source == "weights"


def test_loss_only_a_state_poisoned_again_after_a_rollback_is_caught_again():
    x, y = _data()
    x[2 * BATCH, 0] = np.inf  # every epoch: a finite loss that poisons inj/w; each epoch ends at the same update
    model = _inject_model()
    guard = ks.NanGuard(verbose=0, check_gradients=False, policy="rollback")
    model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, shuffle=False, callbacks=[guard])
    assert _finite(model) and guard.rollbacks == 3 and [r.source for r in guard.reports] == ["weights"] * 3


def test_loss_only_spent_rollbacks_at_train_end_do_not_raise_past_the_other_callbacks(capsys):
    x, y = _data()
    x[3 * BATCH, 0] = np.inf
    model = _inject_model()
    ended = []
    early = keras.callbacks.EarlyStopping(monitor="loss", patience=5, restore_best_weights=True)
    guard = ks.NanGuard(verbose=1, check_gradients=False, policy="rollback", max_rollbacks=1)
    after = keras.callbacks.LambdaCallback(on_train_end=lambda logs: ended.append(True))
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[early, guard, after])
    # the epoch-end rollback used the budget; EarlyStopping then put its recorded (non-finite) weights back
    assert guard.rollbacks == 1 and ended == [True] and not _finite(model)
    assert "rollbacks are spent: the model is NOT usable" in capsys.readouterr().err


def test_state_check_sees_each_new_value_and_many_models_cause_no_retracing_warning():
    import logging
    from keras_scale.step import get_step
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    tf.get_logger().addHandler(handler)
    try:
        for i in range(7):  # a hyper-parameter loop: one state check per model, each traced once
            model = keras.Sequential([keras.Input((3 + i,)), keras.layers.Dense(1 + i)])
            model.compile(optimizer="adam", loss="mse")
            model.optimizer.build(model.trainable_variables)
            step = get_step(model)
            assert step.state_finite()
            model.layers[0].bias.assign(np.full((1 + i,), np.inf, "float32"))
            assert not step.state_finite() and step.non_finite_state() == [model.layers[0].bias.path]
    finally:
        tf.get_logger().removeHandler(handler)
    assert not [m for m in seen if "retracing" in m]


@pytest.mark.parametrize("replicas", [1, 2])
def test_under_a_loss_scale_optimizer_a_nan_input_hidden_by_a_relu_never_reaches_batchnorm(replicas, mirrored):
    """The loss stays finite (relu turns the NaN activations into 0 on CPU) and the gradients are NaN, which a
    LossScaleOptimizer treats as an overflow; the BatchNorm statistics the forward pass wrote are NaN: the guard
    skips the step as an incident, statistics restored, scale untouched, as on a step never taken."""
    strategy = mirrored if replicas == 2 else tf.distribute.get_strategy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 4)).astype("float32")
    y = rng.normal(size=(24, 1)).astype("float32")
    x[15, 1] = np.nan  # the second batch of 8

    def make():
        with strategy.scope():
            keras.utils.set_random_seed(1)
            inp = keras.Input((4,))
            # (no bias before the BatchNorm: its gradient is ~0, and Adam turns round-off there into O(lr) steps)
            h = keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(4, use_bias=False)(inp))
            out = keras.layers.Dense(1)(keras.layers.Dense(8, activation="relu")(h))
            model = keras.Model(inp, out)
            model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2)), loss="mse")
        return model

    def ds(keep):
        return tf.data.Dataset.from_tensor_slices((x[keep], y[keep])).batch(8, drop_remainder=True)

    guarded, reference = make(), make()
    guard = ks.NanGuard(verbose=0)
    history = guarded.fit(ds(np.arange(24)), epochs=1, verbose=0, callbacks=[guard])
    reference.fit(ds(np.r_[0:8, 16:24]), epochs=1, verbose=0)  # plain Keras without that batch
    assert guard.skipped_steps == 1 and history.history["nan_skipped"] == [1]
    assert guard.reports[0].source == "inputs"
    # (2 replicas: Adam on this model's near-zero gradients turns the reduction's round-off into ~5e-5, measured
    # with no NaN at all, guarded or not)
    atol = 1e-6 if replicas == 1 else 2e-4
    for a, b in zip(guarded.weights, reference.weights):  # BatchNorm statistics included
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=atol, err_msg=a.path)
    for a, b in zip(guarded.optimizer.variables, reference.optimizer.variables):  # the loss scale too
        np.testing.assert_allclose(np.asarray(a.numpy()), np.asarray(b.numpy()), rtol=1e-5, atol=atol)


class _ImputeNaN(keras.layers.Layer):
    def call(self, inputs):  # a model that reads NaN as "missing" and imputes 0 itself
        return tf.where(tf.math.is_nan(inputs), tf.zeros_like(inputs), inputs)


def test_under_mixed_float16_a_model_imputing_nan_itself_trains_through_overflows_as_plain_keras():
    """Every batch holds a NaN the model imputes (finite gradients from non-finite data) and the first steps overflow
    in fp16: the loss scaler's business, as in plain Keras (scale halved, step skipped), never a guard incident; the
    guarded run equals plain Keras, scales and weights (a guard that blamed the data would stall the scale)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = 30.0 * rng.normal(size=(64, 1)).astype("float32")
    x[np.arange(0, 64, 16) + 13, 0] = np.nan

    def run(guarded):
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            keras.utils.set_random_seed(1)
            model = keras.Sequential([keras.Input((6,)), _ImputeNaN(), keras.layers.Dense(8), keras.layers.ReLU(),
                                      keras.layers.Dense(1, dtype="float32")])
            model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        finally:
            keras.mixed_precision.set_global_policy("float32")
        scales = []
        record = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: scales.append(float(model.optimizer.dynamic_scale.numpy())))
        guard = ks.NanGuard(verbose=0)
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                  callbacks=[record] + ([guard] if guarded else []))
        return model, scales, guard

    plain, plain_scales, _ = run(False)
    guarded, scales, guard = run(True)
    assert min(plain_scales) < 32768  # the run does overflow (the scale starts at 32768)
    assert scales == plain_scales and guard.skipped_steps == 0 and not guard.reports
    assert int(guarded.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy()) > 0
    for a, b in zip(guarded.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)


class OwnStepModel(keras.Model):
    """keras.io's "Customizing fit(), going lower-level": its own train_step, trackers and ``metrics``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = keras.losses.mean_squared_error(tf.reshape(y, [-1]), tf.reshape(y_pred, [-1]))
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


def test_a_model_with_its_own_train_step_and_trackers_logs_its_epochs_as_plain_keras():
    """Its logs have exactly its metrics' keys, so Keras logs its trackers' results: the guard adds ``nan_skipped``
    and nothing else (Keras's own loss tracker, never updated by such a step, must not turn the epoch into NaN)."""
    x = np.random.default_rng(0).random((64, 8)).astype("float32")
    y = np.random.default_rng(1).random((64, 1)).astype("float32")

    def fit(callbacks):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        model = OwnStepModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="adam")
        return model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False, callbacks=callbacks).history

    expected, history = fit([]), fit([ks.NanGuard(verbose=0)])
    assert history.pop("nan_skipped") == [0, 0]
    assert history.keys() == expected.keys()
    for key in expected:
        np.testing.assert_allclose(history[key], expected[key], rtol=1e-6, err_msg=key)


def test_loss_only_a_new_data_incident_is_reported_although_the_state_is_already_reported_poisoned():
    """A rarely read Embedding row goes non-finite (a zero row under a norm: reported once, as the weights); a later
    batch's own NaN input is its own incident, reported as the inputs, not swallowed as one more step the
    poisoned state explains."""
    class RowNorm(keras.layers.Layer):
        def call(self, inputs):
            return tf.sqrt(tf.reduce_sum(inputs * inputs, axis=-1, keepdims=True))

    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 10, size=(128, 1))
    tokens[40] = 0  # batch 2: the only use of token 0, whose row is zeros (its gradient through the norm is NaN)
    numbers = rng.normal(size=(128, 2)).astype("float32")
    numbers[5 * 16 + 3, 0] = np.nan  # batch 5: a NaN input of its own
    t, n = keras.Input((1,), dtype="int32", name="tok"), keras.Input((2,), name="num")
    embedding = keras.layers.Embedding(10, 4, name="emb")
    out = keras.layers.Add()([RowNorm()(keras.layers.Flatten()(embedding(t))), keras.layers.Dense(1)(n)])
    model = keras.Model({"tok": t, "num": n}, out)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    embedding.embeddings.assign(np.concatenate([np.zeros((1, 4)), np.ones((9, 4))]).astype("float32"))
    guard = ks.NanGuard(verbose=0, check_gradients=False)
    history = model.fit({"tok": tokens, "num": numbers}, np.ones((128, 1)), batch_size=16, epochs=2, shuffle=False,
                        verbose=0, callbacks=[guard])
    assert history.history["nan_skipped"] == [1, 2]
    assert [(r.source, r.epoch) for r in guard.reports] == [("weights", 0), ("inputs", 1)]


def test_a_first_all_skipped_epoch_logs_nan_which_keras_save_best_only_keeps_as_its_best(tmp_path):
    """What the README warns about: the NaN of an epoch that took no step is what Keras's own callbacks compare
    against, and Keras takes a first epoch's NaN as the best, improved on never after (np.less(x, nan) is False):
    monitor a validation metric when a first epoch can be all skipped."""
    x, y = _data(32)
    x_bad = np.full_like(x, np.nan)  # the first epoch: every batch non-finite
    ds = tf.data.Dataset.from_tensor_slices((np.concatenate([x_bad, x]), np.concatenate([y, y]))).batch(BATCH)
    model = linspace_mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    saves = []

    class Recorder(keras.callbacks.ModelCheckpoint):
        def _save_model(self, epoch, batch, logs):
            before = self.best
            super()._save_model(epoch, batch, logs)
            if self.best is not before:
                saves.append(epoch)

    checkpoint = Recorder(str(tmp_path / "best.keras"), monitor="loss", save_best_only=True)
    history = model.fit(ds.take(2).concatenate(ds.skip(2).repeat()), steps_per_epoch=2, epochs=3,
                        verbose=0, callbacks=[ks.NanGuard(verbose=0), checkpoint])
    assert np.isnan(history.history["loss"][0]) and np.isfinite(history.history["loss"][1:]).all()
    assert history.history["nan_skipped"][0] == 2 and saves == [0]  # the NaN epoch, and never a later one


class _OneDense(keras.Model):
    """A subclassed model of one Dense(1) layer, for the two raw-logs models below."""

    def __init__(self, name):
        super().__init__(name=name)
        self.dense = keras.layers.Dense(1)

    def call(self, x, training=False):
        return self.dense(x)


class _RawLogsStep(_OneDense):
    """keras.io's GAN style: an own train_step returning a raw per-batch value, no tracker."""

    def __init__(self):
        super().__init__(name="raw_logs_step")

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_weights), self.trainable_weights))
        return {"d_loss": loss}


class _RawLogsMetrics(_OneDense):
    """keras.io's own compute_metrics dict: a raw per-batch value beside the metrics."""

    def __init__(self):
        super().__init__(name="raw_logs_metrics")

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        logs = super().compute_metrics(x, y, y_pred, sample_weight)
        return {**logs, "d_loss": tf.reduce_mean(tf.square(y_pred - y))}


@pytest.mark.parametrize("bad_batch", [5, 0, 2])  # the epoch's last, its first, one in the middle
@pytest.mark.parametrize("model_class", [_RawLogsStep, _RawLogsMetrics])
def test_a_skipped_step_with_raw_logs_logs_what_plain_keras_without_that_batch_logs(bad_batch, model_class):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(48, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1)) + 0.1).astype("float32")
    bad = x.copy()
    bad[bad_batch * 8 + 1, 0] = np.nan

    class Batches(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.seen = []

        def on_train_batch_end(self, batch, logs=None):
            self.seen.append(float(logs["d_loss"]))

    def run(xx, yy, callbacks):
        keras.utils.set_random_seed(1)
        model = model_class()
        model(xx[:1])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss=None if model_class is _RawLogsStep else "mse")
        batches = Batches()
        history = model.fit(xx, yy, batch_size=8, epochs=2, verbose=0, shuffle=False,
                            callbacks=callbacks + [batches]).history
        return history, batches.seen

    keep = np.ones(48, bool)
    keep[bad_batch * 8:bad_batch * 8 + 8] = False
    want, want_batches = run(x[keep], y[keep], [])
    got, got_batches = run(bad, y, [ks.NanGuard(verbose=0)])
    np.testing.assert_allclose(got["d_loss"], want["d_loss"], rtol=1e-6)
    assert got["nan_skipped"] == [1.0, 1.0]
    # each batch's logs: a skipped batch's are the epoch's previous taken batch's (its own, NaN, with none before)
    expected, taken = [], iter(want_batches)
    for epoch in range(2):
        for b in range(6):
            expected.append((expected[-1] if b else float("nan")) if b == bad_batch else next(taken))
    np.testing.assert_allclose(got_batches, expected, rtol=1e-6)
