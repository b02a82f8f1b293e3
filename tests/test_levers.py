"""compare_xla / compare_precision: same start, same batches, sane timings, loss agreement, one-line advice."""
import numpy as np
import pytest

import keras
import keras_scale as ks
from keras_scale.levers import LeverComparison


def _build():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def _data(n=64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


def _sane(result, steps):
    assert isinstance(result, LeverComparison)
    for run in (result.baseline, result.candidate):
        assert 0 < run.median_step_s < 5.0
        assert run.compile_s >= 0
        assert len(run.losses) == steps + 1 and all(np.isfinite(run.losses))
        assert run.peak_memory_mb is not None
    assert result.speedup == pytest.approx(result.baseline.median_step_s / result.candidate.median_step_s)
    assert result.use_candidate == (result.losses_agree and result.speedup >= 1.05)
    # it trained: the running-mean loss went down over the steps, in both runs
    assert result.baseline.losses[-1] < result.baseline.losses[0]


def test_compare_xla_on_a_tiny_model(capsys):
    result = ks.compare_xla(_build, _data(), steps=6, batch_size=16)
    _sane(result, 6)
    # identical initial weights and batches: XLA changes only float rounding
    assert result.losses_agree and result.loss_rel_diff < 1e-4
    assert result.baseline.label == "jit_compile=False" and result.candidate.label == "jit_compile=True"
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line == str(result) and line.startswith("xla: ")
    assert ("use jit_compile=True" in line) == result.use_candidate


def test_compare_precision_on_a_model_instance_leaves_it_untouched(capsys):
    model = _build()
    before = [w.copy() for w in model.get_weights()]
    result = ks.compare_precision(model, _data(), steps=5, batch_size=16, policy="mixed_bfloat16")
    _sane(result, 5)
    assert result.candidate.label == "policy=mixed_bfloat16"
    assert result.losses_agree  # bf16 rounding stays within the 5% default on this tiny regression
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("precision: ")


def test_disagreeing_losses_mean_keep_the_baseline():
    result = ks.compare_precision(_build, _data(), steps=4, batch_size=16, policy="mixed_bfloat16",
                                  loss_rtol=1e-12, verbose=False)
    assert not result.losses_agree and not result.use_candidate
    assert result.recommendation.startswith("keep float32: losses differ by")


def test_compare_xla_refuses_a_multi_replica_scope(mirrored):
    with mirrored.scope():
        with pytest.raises(ValueError, match="inside a strategy scope with 2 replicas"):
            ks.compare_xla(_build, _data(), steps=3)


def test_bad_input_is_rejected_early():
    with pytest.raises(ValueError, match="steps must be an integer >= 3"):
        ks.compare_xla(_build, _data(), steps=2)
    with pytest.raises(ValueError, match="not compiled"):
        ks.compare_xla(keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)]), _data(), steps=3)
    with pytest.raises(TypeError, match="data must be a batched tf.data.Dataset"):
        ks.compare_xla(_build, "train.csv", steps=3)
    with pytest.raises(ValueError, match="fewer than batch_size=32"):
        ks.compare_xla(_build, _data(8), steps=3)
    with pytest.raises(ValueError, match="policy must be 'mixed_float16' or 'mixed_bfloat16'.*'float64'"):
        ks.compare_precision(_build, _data(), steps=3, policy="float64")
    with pytest.raises(TypeError, match="model_or_builder must be a compiled keras.Model or a function"):
        ks.compare_xla(42, _data(), steps=3)


def test_multi_input_model_with_list_of_arrays():
    def build():
        a, b = keras.Input((4,)), keras.Input((3,))
        model = keras.Model([a, b], keras.layers.Dense(1)(keras.layers.Concatenate()([a, b])))
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return model

    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(64, 4)).astype("float32"), rng.normal(size=(64, 3)).astype("float32")]
    result = ks.compare_xla(build, (xs, xs[0][:, :1]), steps=3, batch_size=16, verbose=False)
    assert result.losses_agree and len(result.candidate.losses) == 4
