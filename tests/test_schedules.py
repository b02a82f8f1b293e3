import math

import keras
import numpy as np
import os

import pytest
import tensorflow as tf

import keras_scale as ks
from keras_scale.schedules import ScaledSchedule, lr_multiplier, scale_learning_rate


def test_formula_at_issue_example_points():
    lr = ks.WarmupCosine(peak_lr=1.0, total_steps=1000, warmup_steps=100)
    got = {s: float(lr(s)) for s in (0, 99, 100, 550, 1000, 5000)}
    assert got[0] == pytest.approx(0.01)
    assert got[99] == pytest.approx(1.0)
    assert got[100] == pytest.approx(1.0)
    assert got[550] == pytest.approx(0.5, abs=1e-6)
    assert got[1000] == pytest.approx(0.0, abs=1e-7)
    assert got[5000] == pytest.approx(0.0, abs=1e-7)


def test_formula_matches_reference_with_initial_and_final_lr():
    peak, init, final, total, warm = 0.4, 0.01, 0.001, 300, 30
    lr = ks.WarmupCosine(peak, total, warm, initial_lr=init, final_lr=final)
    for s in range(0, 400, 7):
        if s < warm:
            ref = init + (peak - init) * (s + 1) / warm
        elif s < total:
            ref = final + 0.5 * (peak - final) * (1 + math.cos(math.pi * (s - warm) / (total - warm)))
        else:
            ref = final
        assert float(lr(s)) == pytest.approx(ref, rel=1e-5, abs=1e-7), s


@pytest.mark.parametrize("dtype", [tf.int32, tf.int64, tf.float32, tf.float64])
def test_graph_safe_any_step_dtype(dtype):
    lr = ks.WarmupCosine(1.0, 1000, 100)

    @tf.function(jit_compile=True)
    def f(step):
        return lr(step)

    assert float(f(tf.constant(550, dtype))) == pytest.approx(0.5, abs=1e-6)


def test_no_warmup_starts_at_peak():
    lr = ks.WarmupCosine(0.1, total_steps=10)
    assert float(lr(0)) == pytest.approx(0.1)


def test_from_epochs():
    lr = ks.WarmupCosine.from_epochs(0.1, epochs=10, steps_per_epoch=50, warmup_epochs=2)
    assert (lr.total_steps, lr.warmup_steps) == (500, 100)


def _tiny_model(lr):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.AdamW(lr), loss="mse")
    return model


def test_save_load_round_trip(tmp_path):
    lr = ks.WarmupCosine(0.5, 200, 20, initial_lr=0.05, final_lr=0.01)
    model = _tiny_model(lr)
    x, y = np.random.rand(16, 4).astype("float32"), np.random.rand(16, 1).astype("float32")
    model.fit(x, y, epochs=1, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    sched = loaded.optimizer._learning_rate
    assert isinstance(sched, ks.WarmupCosine)
    assert sched.get_config() == lr.get_config()
    for s in (0, 19, 20, 100, 200):
        assert float(sched(s)) == pytest.approx(float(lr(s)))


def test_trains_under_mirrored_strategy(mirrored):
    with mirrored.scope():
        lr = ks.WarmupCosine(0.1, total_steps=8, warmup_steps=2)
        model = _tiny_model(lr)
    x, y = np.random.rand(64, 4).astype("float32"), np.random.rand(64, 1).astype("float32")
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 8
    # the optimizer reads the schedule at its own iteration count: past total_steps -> final_lr
    assert float(model.optimizer.learning_rate) == pytest.approx(0.0, abs=1e-7)


def test_multiplier_lowers_schedule_driven_lr_without_retrace():
    opt = keras.optimizers.SGD(ks.WarmupCosine(0.2, total_steps=100))
    before = float(opt.learning_rate)
    assert scale_learning_rate(opt, 0.5) is False
    assert float(opt.learning_rate) == pytest.approx(before * 0.5)
    assert float(lr_multiplier(opt)) == pytest.approx(0.5)


def test_scale_learning_rate_wraps_foreign_schedule_and_floats():
    opt = keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5))
    assert scale_learning_rate(opt, 0.1) is True
    assert isinstance(opt._learning_rate, ScaledSchedule)
    assert float(opt.learning_rate) == pytest.approx(0.01)
    opt2 = keras.optimizers.SGD(0.1)
    scale_learning_rate(opt2, 0.5)
    assert float(opt2.learning_rate) == pytest.approx(0.05)


def test_scale_lr_rules():
    assert ks.scale_lr(0.1, global_batch=1024, base_batch=256) == pytest.approx(0.4)
    assert ks.scale_lr(0.1, global_batch=1024, base_batch=256, rule="sqrt") == pytest.approx(0.2)
    assert ks.scale_lr(0.1, global_batch=128) == pytest.approx(0.05)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(peak_lr=1.0, total_steps=0), "total_steps"),
        (dict(peak_lr=1.0, total_steps=-5), "total_steps"),
        (dict(peak_lr=1.0, total_steps=10, warmup_steps=11), "warmup_steps"),
        (dict(peak_lr=-1.0, total_steps=10), "peak_lr"),
        (dict(peak_lr=1.0, total_steps=10, initial_lr=-0.1), "initial_lr"),
        (dict(peak_lr=1.0, total_steps=10, final_lr=float("nan")), "final_lr"),
        (dict(peak_lr=1.0, total_steps=10, warmup_steps=-1), "warmup_steps"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ks.WarmupCosine(**kwargs)


def test_bad_scale_lr_input():
    with pytest.raises(ValueError, match="unknown rule"):
        ks.scale_lr(0.1, 512, rule="cubic")
    with pytest.raises(ValueError, match="base_lr"):
        ks.scale_lr(-0.1, 512)
    with pytest.raises(ValueError, match="global_batch"):
        ks.scale_lr(0.1, 0)
    with pytest.raises(ValueError, match="factor"):
        scale_learning_rate(keras.optimizers.SGD(0.1), 0.0)


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")  # the `plot` extra
    path = ks.WarmupCosine(1e-3, 100, 10).plot(str(tmp_path / "lr.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_learning_rate_logger_writes_the_warmup_per_step(tmp_path):
    x, y = np.random.rand(64, 4).astype("float32"), np.random.rand(64, 1).astype("float32")
    lr = ks.WarmupCosine(0.4, total_steps=8, warmup_steps=4)
    model = _tiny_model(lr)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[ks.LearningRateLogger(str(tmp_path))])
    events = list(tmp_path.rglob("events.out.tfevents.*"))
    logged = {e.step: float(tf.make_ndarray(v.tensor)) for e in tf.compat.v1.train.summary_iterator(str(events[0]))
              for v in e.summary.value if v.tag == "optimizer/learning_rate"}
    assert sorted(logged) == list(range(8))
    for step, value in logged.items():
        assert value == pytest.approx(float(lr(step)), rel=1e-5)


def test_plot_reports_the_file_it_wrote_for_a_name_without_extension(tmp_path):
    pytest.importorskip("matplotlib")
    path = ks.WarmupCosine(1.0, total_steps=100, warmup_steps=10).plot(str(tmp_path / "lr"))
    assert path.endswith("lr.png") and os.path.exists(path)
