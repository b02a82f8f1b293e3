"""Composition x lifecycle: models x pieces x strategies x endings, then a plain Keras fit.

Whatever keras_scale pieces a fit used and however it ended (finished, raised mid-epoch, stopped), a later
plain ``model.fit`` must give exactly the weights it gives on a model that never met keras_scale (a twin with
the same weights and optimizer state).

Model kinds: Sequential; functional with two outputs, loss_weights and metrics; a subclass with call(); a subclass
with call() and its own train_step; keras-io's GAN (a subclass WITHOUT call(), its own compile and train_step, two
optimizers held as attributes, or in a dict); BatchNorm + Dropout; a masked embedding model. After the ending, both
the model and an untouched twin with the same state run train_on_batch and then a second, plain fit.

The full product is too slow for the suite; the cells below are a covering design: every model x piece pair that
applies appears once (wrap refuses a model with its own train_step; ks.fit needs Keras's compile), and strategy and
ending rotate so that every (model, strategy), (model, ending), (piece, strategy), (piece, ending) and
(strategy, ending) pair is covered.
"""
import numpy as np
import pytest
import keras
import tensorflow as tf

import keras_scale as ks
from keras_scale import lifecycle
from keras_scale import state as training_state
from keras_scale import sync_bn
from tests._models import make_gan

MODELS = ("sequential", "two_outputs_metrics", "own_train_step", "batchnorm", "masked_embedding",
          "subclass_call", "gan_attrs", "gan_dict")
GANS = ("gan_attrs", "gan_dict")
PIECES = ("wrap", "nan_guard", "checkpoint", "all", "ks_fit")
# what does not apply: wrap refuses an own train_step (tests/test_state.py), ks.fit compiles with Keras's compile
_NOT_APPLICABLE = {(g, p) for g in GANS for p in ("wrap", "ks_fit")}
STRATEGIES = ("default", "mirrored")
ENDINGS = ("finished", "raised", "stopped")
N, BATCH, VOCAB = 64, 16, 12


class _OwnStep(keras.Model):
    def __init__(self):
        super().__init__(name="own_step")
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, data):
        x, y = data[0], data[1]
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        for metric in self.metrics:
            metric.update_state(loss) if metric.name == "loss" else metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class _SubclassCall(keras.Model):
    def __init__(self):
        super().__init__(name="subclass_call")
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))


def _build(kind):
    keras.utils.set_random_seed(7)
    if kind in GANS:
        return make_gan(in_dict=kind == "gan_dict", seed=7)
    if kind == "subclass_call":
        model = _SubclassCall()  # unbuilt: built by its first step
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    elif kind == "sequential":
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    elif kind == "two_outputs_metrics":
        inputs = keras.Input((6,))
        h = keras.layers.Dense(8, activation="relu")(inputs)
        model = keras.Model(inputs, {"a": keras.layers.Dense(1, name="a")(h),
                                     "b": keras.layers.Dense(3, activation="softmax", name="b")(h)})
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss={"a": "mse", "b": "sparse_categorical_crossentropy"},
                      metrics={"b": ["accuracy"]})
    elif kind == "own_train_step":
        model = _OwnStep()
        model(np.zeros((1, 6), "float32"))
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    elif kind == "batchnorm":
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.BatchNormalization(),
                                  keras.layers.Activation("relu"), keras.layers.Dropout(0.2), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse", metrics=["mae"])
    else:
        model = keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(VOCAB, 4, mask_zero=True),
                                  keras.layers.Dense(VOCAB)])
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    return model


def _data(kind):
    rng = np.random.default_rng(3)
    if kind == "masked_embedding":
        x = rng.integers(1, VOCAB, size=(N, 5)).astype("int32")
        x[::3, 3:] = 0
        return x, rng.integers(0, VOCAB, size=(N, 5)).astype("int32")
    x = rng.normal(size=(N, 6)).astype("float32")
    if kind in GANS:
        return x, None
    if kind == "two_outputs_metrics":
        return x, {"a": x[:, :1] * 2.0, "b": (x[:, 1] > 0).astype("int32") + (x[:, 2] > 0).astype("int32")}
    return x, (x @ rng.normal(size=(6, 1))).astype("float32")


class _RaiseAt(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            raise RuntimeError("simulated crash mid-epoch")


class _StopAt(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            self.model.stop_training = True


def _cells():
    cells = []
    for i, model in enumerate(MODELS):
        for j, piece in enumerate(PIECES):
            if (model, piece) not in _NOT_APPLICABLE:
                # (plain Keras cannot train the GAN under a strategy: its symbolic build needs call())
                strategy = "default" if model in GANS else STRATEGIES[(i + j) % 2]
                cells.append((model, piece, strategy, ENDINGS[(i + 2 * j) % 3]))
    return cells


def _copy_state(src, dst, strategy, x, y):
    """Every variable of the training state (keras_scale.state: weights, seed states, every optimizer)."""
    batches = tf.data.Dataset.from_tensor_slices(x if y is None else (x, y)).batch(BATCH)
    with strategy.scope():
        for model in (src, dst):
            training_state.build(model, iter(strategy.experimental_distribute_dataset(batches)))
    theirs = training_state.variables(src, include_metrics=False)
    ours = training_state.variables(dst, include_metrics=False)
    assert len(theirs) == len(ours)
    for a, b in zip(ours.values(), theirs.values()):
        a.assign(b)


def _keras_scale_fit(model_kind, piece, strategy, ending, tmp_path):
    """Train with the piece and the ending; return the (possibly wrapped) model that was trained."""
    x, y = _data(model_kind)
    sample_weight = None
    nan_guard_piece = piece in ("nan_guard", "all", "ks_fit")
    callbacks = []
    if ending == "raised":
        callbacks.append(_RaiseAt())
    elif ending == "stopped" and not nan_guard_piece:
        callbacks.append(_StopAt())
    elif ending == "stopped" and model_kind in GANS:  # a NaN batch: the discriminator's gradients are NaN
        x = x.copy()
        x[2 * BATCH] = np.nan
    elif ending == "stopped":  # NanGuard(policy="stop") ends the fit at a NaN batch
        sample_weight = np.ones(N, "float32")
        sample_weight[2 * BATCH:2 * BATCH + 2] = np.nan

    if piece == "ks_fit":
        built = {}

        def builder():
            built["model"] = _build(model_kind)
            return built["model"]

        if nan_guard_piece and ending == "stopped":
            callbacks.append(ks.NanGuard(policy="stop", verbose=0))
        run = lambda: ks.fit(builder, x, y, per_replica_batch_size=BATCH // strategy.num_replicas_in_sync,
                             strategy=strategy, epochs=2, callbacks=callbacks, verbose=0, shuffle=False,
                             checkpoint_dir=str(tmp_path / "ks_fit"), sample_weight=sample_weight)
        if ending == "raised":
            with pytest.raises(RuntimeError, match="simulated"):
                run()
        else:
            run()
        return built["model"]

    with strategy.scope():
        model = _build(model_kind)
        if piece in ("wrap", "all") and model_kind not in ("own_train_step",) + GANS:
            model = ks.wrap(model, accum=2)
            model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=_build(model_kind).loss,
                          metrics=["mae"] if model_kind in ("sequential", "batchnorm") else None)
    if piece in ("nan_guard", "all"):
        callbacks.append(ks.NanGuard(policy="stop" if ending == "stopped" else "skip", verbose=0))
    if piece in ("checkpoint", "all"):
        callbacks.append(ks.ChiefCheckpoint(str(tmp_path / "ckpt"), save_freq=2, verbose=0))
    if piece == "all":
        callbacks += [ks.LearningRateLogger(str(tmp_path / "tb")), ks.HostMemoryWatch(),
                      ks.ProfileWindow(str(tmp_path / "prof"), start_step=1000, num_steps=2)]
    if ending == "raised":
        with pytest.raises(RuntimeError, match="simulated"):
            model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False, callbacks=callbacks,
                      sample_weight=sample_weight)
    else:
        model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False, callbacks=callbacks,
                  sample_weight=sample_weight)
    return model


def _params():
    # the MirroredStrategy cells (6-60 s each on 2 cores) run with the slow tests: make test-slow, run by CI
    return [pytest.param(*cell, marks=pytest.mark.slow) if cell[2] == "mirrored" else cell for cell in _cells()]


@pytest.mark.parametrize("model_kind,piece,strategy_name,ending", _params())
def test_then_plain_keras_fit_behaves_as_on_an_untouched_model(model_kind, piece, strategy_name, ending, tmp_path,
                                                               mirrored):
    strategy = mirrored if strategy_name == "mirrored" else tf.distribute.get_strategy()
    model = _keras_scale_fit(model_kind, piece, strategy, ending, tmp_path)
    if ending != "raised":  # (a died fit's state is undone at the model's next use: train_on_batch below)
        assert lifecycle.pending(model) == 0
    with strategy.scope():
        twin = _build(model_kind)
        if isinstance(model, ks.AccumulatingModel):
            twin = ks.wrap(twin, accum=model.accum)
            twin.compile(optimizer=keras.optimizers.Adam(1e-2), loss=model.loss, metrics=None)
    if any(getattr(layer, "synchronized", False) for layer in sync_bn.batchnorm_layers(model)):
        ks.sync_batchnorm(twin)  # ks.fit synchronizes BatchNorm on purpose (per-replica batch < 16)
    x, y = _data(model_kind)
    _copy_state(model, twin, strategy, x, y)
    if y is None:
        one = x[:BATCH]
    else:
        one = (x[:BATCH], tf.nest.map_structure(lambda t: t[:BATCH], y))
    for _ in range(2):  # train_on_batch right after the ending: as on the twin (no halted or wrapped step left)
        got = model.train_on_batch(*(one if isinstance(one, tuple) else (one,)), return_dict=True)
        want = twin.train_on_batch(*(one if isinstance(one, tuple) else (one,)), return_dict=True)
        assert {k: float(v) for k, v in got.items() if k != "nan_skipped"} == pytest.approx(
            {k: float(v) for k, v in want.items()}, rel=1e-6)
    # (a wrapped model's train_on_batch runs the composed step: its optimizer switches stay until the next fit ends)
    assert lifecycle.pending(model) == (1 if isinstance(model, ks.AccumulatingModel) else 0)
    h_model = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False)
    h_twin = twin.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False)
    assert len(next(iter(h_model.history.values()))) == 2  # the plain fit ran its epochs (no left-over initial epoch)
    assert sorted(h_model.history) == sorted(h_twin.history)
    for key in h_twin.history:
        np.testing.assert_allclose(h_model.history[key], h_twin.history[key], rtol=1e-6)
    for a, b in zip(training_state.variables(model).values(), training_state.variables(twin).values()):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    assert lifecycle.pending(model) == 0


# ---------------------------------------------------------------- the override axis
# A model's own test_step / predict_step / compute_metrics (and call(training=...)), or its own train_step with Mean
# trackers (keras-io's VAE), x wrap / NanGuard / ChiefCheckpoint / ProfileWindow, against plain Keras on the same
# data (for NanGuard: plain Keras without the non-finite batch): the logs (training and validation), evaluate,
# predict and the weights. Small models, two epochs of four batches; the plain Keras references are shared.
OVERRIDES = ("test_step", "predict_step", "compute_metrics", "compute_metrics_dict", "own_train_step_trackers")
OVERRIDE_PIECES = ("wrap", "nan_guard", "checkpoint", "profile_window")
_O_X = np.random.default_rng(11).normal(size=(80, 3)).astype("float32")
_O_Y = (_O_X @ np.array([[1.0], [-2.0], [0.5]], "float32") + 0.1).astype("float32")
_O_TRAIN, _O_VAL = slice(0, 64), slice(64, 80)
_O_BAD = slice(16, 32)  # the second batch of each epoch: non-finite for the NanGuard cells


class _Overrides(keras.Model):
    """call(training=...) differs between training and inference, so a lost ``training=`` shows in every number."""

    def __init__(self, kind):
        super().__init__(name=f"overrides_{kind}")
        self.kind = kind
        self.hidden = keras.layers.Dense(4, activation="tanh")
        self.out = keras.layers.Dense(1)
        self.max_err = keras.metrics.Mean(name="max_err")
        self.pred_mean = keras.metrics.Mean(name="pred_mean")

    def call(self, x, training=False):
        y = self.out(self.hidden(x))
        return y + 0.25 if training else y

    def test_step(self, data):
        if self.kind != "test_step":
            return super().test_step(data)
        x, y = data[0], data[1]
        y_pred = self(x, training=False)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred, training=False)
        self.max_err.update_state(tf.reduce_max(tf.abs(y_pred - y)))
        # (the optimizer read in it, as keras.io's examples do: lent by a wrapper with its compilation)
        return {"eval_loss": loss, "max_err": self.max_err.result(), "lr": self.optimizer.learning_rate + 0.0}

    def predict_step(self, data):
        if self.kind != "predict_step":
            return super().predict_step(data)
        x = data[0] if isinstance(data, tuple) else data
        y_pred = self(x, training=False)
        return {"out": y_pred, "twice": 2.0 * y_pred}

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        result = super().compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        if self.kind == "compute_metrics_dict":  # keras.io's own dict: a value that is no metric's is logged too
            # (one the same per micro-batch as per batch: split, a batch statistic is the last micro-batch's)
            return {**result, "features": tf.cast(tf.shape(x)[-1], "float32") + 0.5}
        if self.kind != "compute_metrics":
            return result
        self.pred_mean.update_state(y_pred)  # (a per-sample mean: the same over micro-batches as over the batch)
        return self.get_metrics_result()


class _VaeLike(keras.Model):
    """keras-io's VAE, shrunk: its own train_step, a seeded sampling, Mean trackers behind a ``metrics`` property."""

    def __init__(self):
        super().__init__(name="vae_like")
        self.encoder = keras.layers.Dense(2)
        self.decoder = keras.layers.Dense(3)
        self.seed = keras.random.SeedGenerator(5)
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

    def call(self, x):
        return self.decoder(self.encoder(x))

    def train_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        with tf.GradientTape() as tape:
            z_mean = self.encoder(x)
            z = z_mean + 0.1 * keras.random.normal(tf.shape(z_mean), seed=self.seed)
            reconstruction_loss = tf.reduce_mean(tf.square(self.decoder(z) - x))
            kl_loss = 0.01 * tf.reduce_mean(tf.square(z_mean))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {"loss": self.total_loss_tracker.result(),
                "reconstruction_loss": self.reconstruction_loss_tracker.result(),
                "kl_loss": self.kl_loss_tracker.result()}


def _override_model(kind):
    keras.utils.set_random_seed(7)
    if kind == "own_train_step_trackers":
        model = _VaeLike()
        model(_O_X[:1])
        model.compile(optimizer=keras.optimizers.Adam(1e-2))
        return model
    model = _Overrides(kind)
    model(_O_X[:1])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return model


def _override_data(kind, without_bad):
    keep = np.ones(64, bool)
    if without_bad:
        keep[_O_BAD] = False
    x, y = _O_X[_O_TRAIN][keep], _O_Y[_O_TRAIN][keep]
    return (x, None) if kind == "own_train_step_trackers" else (x, y)


def _override_run(model, kind, x, y, callbacks):
    vae = kind == "own_train_step_trackers"  # (keras-io's VAE has no loss to evaluate, with or without keras_scale)
    val = (_O_X[_O_VAL], _O_Y[_O_VAL])
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False, callbacks=callbacks,
                        validation_data=None if vae else val)
    return {"history": {k: v for k, v in history.history.items() if k != "nan_skipped"},
            "evaluate": {} if vae else model.evaluate(*val, batch_size=8, verbose=0, return_dict=True),
            "predict": model.predict(_O_X[_O_VAL], batch_size=8, verbose=0),
            "weights": [w.numpy() for w in ks.unwrap(model).weights]}


_OVERRIDE_REFERENCES = {}


def _scoped(strategy, build, *args):
    with strategy.scope():
        return build(*args)


def _override_reference(kind, without_bad):
    key = (kind, without_bad)
    if key not in _OVERRIDE_REFERENCES:
        _OVERRIDE_REFERENCES[key] = _override_run(_override_model(kind), kind, *_override_data(kind, without_bad), [])
    return _OVERRIDE_REFERENCES[key]


def _assert_same(got, want):
    assert sorted(got["history"]) == sorted(want["history"])
    for key in want["history"]:
        np.testing.assert_allclose(got["history"][key], want["history"][key], rtol=2e-5, atol=1e-6, err_msg=key)
    assert sorted(got["evaluate"]) == sorted(want["evaluate"])
    for key in want["evaluate"]:
        np.testing.assert_allclose(got["evaluate"][key], want["evaluate"][key], rtol=2e-5, atol=1e-6, err_msg=key)
    assert tf.nest.map_structure(lambda _: 0, got["predict"]) == tf.nest.map_structure(lambda _: 0, want["predict"])
    for a, b in zip(tf.nest.flatten(got["predict"]), tf.nest.flatten(want["predict"])):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
    for a, b in zip(got["weights"], want["weights"]):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


def _override_cells():
    cells = [(kind, piece, "default") for kind in OVERRIDES for piece in OVERRIDE_PIECES]
    # under MirroredStrategy (the overrides run in one thread per replica): slow, with make test-slow
    return cells + [pytest.param(kind, piece, "mirrored", marks=pytest.mark.slow) for kind, piece in (
        ("test_step", "wrap"), ("compute_metrics", "nan_guard"), ("own_train_step_trackers", "nan_guard"))]


def test_a_test_step_of_its_own_reads_the_optimizer_of_a_wrapper_compiled_after_wrap():
    # (the override cells compile before wrap: the inner model has the optimizer already)
    def build():
        keras.utils.set_random_seed(7)
        model = _Overrides("test_step")
        model(_O_X[:1])
        return model

    plain = build()
    plain.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    wrapped = ks.wrap(build(), accum=2)
    wrapped.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    val = (_O_X[_O_VAL], _O_Y[_O_VAL])
    want = plain.evaluate(*val, batch_size=8, verbose=0, return_dict=True)
    got = wrapped.evaluate(*val, batch_size=8, verbose=0, return_dict=True)
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=2e-5, err_msg=key)


@pytest.mark.parametrize("kind,piece,strategy_name", _override_cells())
def test_a_models_overrides_are_kept_as_plain_keras_keeps_them(kind, piece, strategy_name, tmp_path, mirrored):
    if strategy_name == "mirrored":
        with mirrored.scope():
            model = _override_model(kind)
        want = _override_run(_scoped(mirrored, _override_model, kind), kind, *_override_data(kind, piece == "nan_guard"),
                             [])
    else:
        model = _override_model(kind)
        want = _override_reference(kind, without_bad=piece == "nan_guard")
    wraps = piece in ("wrap", "checkpoint", "profile_window")
    if wraps and kind == "own_train_step_trackers":
        with pytest.raises(ValueError, match="_VaeLike, which defines its own train_step"):
            ks.wrap(model, accum=2)  # refused, naming the method (NanGuard guards it unwrapped: the nan_guard cell)
        if piece == "wrap":
            return
    elif wraps:
        model = ks.wrap(model, accum=2)  # compiled first: the compilation carries over
    callbacks = {"wrap": [], "nan_guard": [ks.NanGuard(verbose=0)],
                 "checkpoint": [ks.ChiefCheckpoint(str(tmp_path / "ckpt"), save_freq=2, verbose=0)],
                 "profile_window": [ks.ProfileWindow(str(tmp_path / "prof"), start_step=2, num_steps=1,
                                                     print_summary=False)]}[piece]
    x, y = _override_data(kind, without_bad=False)
    if piece == "nan_guard":
        x = x.copy()
        x[_O_BAD] = np.nan
    got = _override_run(model, kind, x, y, callbacks)
    _assert_same(got, want)
    if piece == "nan_guard":
        assert callbacks[0].skipped_steps == 2  # one per epoch
    if piece == "profile_window":
        assert callbacks[0].profiled_steps == [2]
