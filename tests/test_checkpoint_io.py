"""ChiefCheckpoint's files (checkpoint/format.py): TensorFlow's own tensor bundle that every TensorFlow tool reads,
written new for every checkpoint (a reader never sees bytes change), every entry checked (CRC, dtype, shape)
before anything is assigned, orphans of killed writes removed, and ks.load_checkpoint / keras-scale checkpoint."""
import json
import os
import subprocess
import sys
import zlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_scale as ks
from keras_scale.callbacks.checkpoint import format as io
from keras_scale.callbacks.checkpoint import list_checkpoints, read_checkpoint
from tests._helpers import REPO_ROOT, StopAfter, fit, make_model, subprocess_env, weights

KERNEL = "model_variables/0/.ATTRIBUTES/VARIABLE_VALUE"


@pytest.fixture
def parallel(request, monkeypatch):
    """``True``: every bundle is read by several RestoreV2 ops at once (as one over 16 MiB is), else by one."""
    monkeypatch.setattr(io, "_PARALLEL_READ_BYTES", 0 if request.param else 1 << 62)
    monkeypatch.setattr(io.os, "cpu_count", lambda: 2)  # (one core would read in one op)
    return request.param


@pytest.mark.parametrize("parallel", [False, True], ids=["one_read", "parallel_reads"], indirect=True)
def test_round_trip_of_every_kind_of_variable(tmp_path, parallel):
    items = {"w": [tf.Variable(np.random.RandomState(1).rand(33, 7).astype("float32")),
                   tf.Variable(np.arange(5, dtype="int32"))],
             "h": tf.Variable(tf.constant([1.5, -2.0], dtype=tf.bfloat16)),
             "flag": tf.Variable(True),
             "pos": {"step": tf.Variable(12345678901, dtype=tf.int64)},
             "text": tf.Variable("päth {json}")}
    prefix = str(tmp_path / "ckpt-1")
    io.write_checkpoint(prefix, io.flatten(items))
    assert not io.is_raw(prefix)
    reader = tf.train.load_checkpoint(prefix)  # TensorFlow's own reader
    assert reader.get_variable_to_shape_map()["w/0/.ATTRIBUTES/VARIABLE_VALUE"] == [33, 7]
    assert reader.get_tensor("text/.ATTRIBUTES/VARIABLE_VALUE").decode() == "päth {json}"
    assert int(reader.get_tensor("pos/step/.ATTRIBUTES/VARIABLE_VALUE")) == 12345678901
    fresh = {"w": [tf.Variable(tf.zeros((33, 7))), tf.Variable(tf.zeros(5, tf.int32))],
             "h": tf.Variable(tf.zeros(2, tf.bfloat16)), "flag": tf.Variable(False),
             "pos": {"step": tf.Variable(0, dtype=tf.int64)}, "text": tf.Variable("")}
    io.read_into(prefix, io.flatten(fresh))
    for key, var in io.flatten(items).items():
        np.testing.assert_array_equal(io.flatten(fresh)[key].numpy(), var.numpy())


@pytest.mark.parametrize("parallel", [False, True], ids=["one_read", "parallel_reads"], indirect=True)
def test_damage_is_found_before_any_variable_is_assigned(tmp_path, parallel):
    first, second = tf.Variable(np.ones((4, 64), "float32")), tf.Variable(np.full((64, 64), 2.0, "float32"))
    prefix = str(tmp_path / "ckpt-1")
    io.write_checkpoint(prefix, io.flatten({"w": [first, second]}))
    data = prefix + io.DATA_SUFFIX
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) - 1000)  # inside the second tensor
        f.write(b"\xff\x00\xff\x00")
    target = [tf.Variable(tf.zeros((4, 64))), tf.Variable(tf.zeros((64, 64)))]
    with pytest.raises(io.CorruptCheckpointError, match="Checksum does not match"):  # (the RestoreV2 read fails)
        io.read_into(prefix, io.flatten({"w": target}))
    assert not target[0].numpy().any() and not target[1].numpy().any()  # nothing half-restored


@pytest.mark.parametrize("parallel", [False, True], ids=["one_read", "parallel_reads"], indirect=True)
def test_a_save_at_the_same_prefix_during_a_restore_never_gives_a_mix(tmp_path, parallel, monkeypatch):
    """Another process restores ckpt-N while training writes ckpt-N again (after falling back to an older one):
    RestoreV2 opens files by name, so the groups read after the save would come from the new files. The restore
    gives the checkpoint the reader opened, every tensor of it."""
    old = {"w": [tf.Variable(np.full((64, 64), float(i), "float32")) for i in range(4)]}
    new = {"w": [tf.Variable(np.full((64, 64), 100.0 + i, "float32")) for i in range(4)]}
    prefix = str(tmp_path / "ckpt-6")
    io.write_checkpoint(prefix, io.flatten(old))
    original, calls = tf.raw_ops.RestoreV2, []

    def restore_then_save(**kwargs):
        calls.append(len(kwargs["tensor_names"]))
        first = len(calls) == 1
        out = original(**kwargs)  # (another group may read before, during or after the save: all must end alike)
        if first:
            io.write_checkpoint(prefix, io.flatten(new))  # lands after the first read
        return out

    monkeypatch.setattr(tf.raw_ops, "RestoreV2", restore_then_save)
    target = {"w": [tf.Variable(tf.zeros((64, 64))) for _ in range(4)]}
    io.read_into(prefix, io.flatten(target))
    assert len(calls) == (2 if parallel else 1)
    assert [float(v.numpy()[0, 0]) for v in target["w"]] == [0.0, 1.0, 2.0, 3.0]  # all from the files it opened


def test_a_different_shape_or_dtype_is_a_value_error_naming_both(tmp_path):
    prefix = str(tmp_path / "ckpt-1")
    io.write_checkpoint(prefix, io.flatten({"w": [tf.Variable(tf.ones((3, 4)))]}))
    with pytest.raises(ValueError, match=r"shape \(3, 4\) there .* \(4, 3\)"):
        io.read_into(prefix, io.flatten({"w": [tf.Variable(tf.zeros((4, 3)))]}))
    target = tf.Variable(tf.zeros((3, 4), tf.int32))
    with pytest.raises(ValueError, match="dtype float32 there .* int32"):
        io.read_into(prefix, io.flatten({"w": [target]}))
    assert not target.numpy().any()


def _rewrite_with(prefix, key, transform):
    """Rewrite checkpoint ``prefix`` with one tensor changed by ``transform`` (a new, self-consistent file: its CRC
    matches the new bytes) -- a damaged or foreign checkpoint that no checksum can tell."""
    reader = tf.train.load_checkpoint(prefix)
    values = {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}
    values[key] = transform(values[key])
    for name in os.listdir(os.path.dirname(prefix)):
        if name.startswith(os.path.basename(prefix) + "."):
            os.remove(os.path.join(os.path.dirname(prefix), name))
    names = sorted(values)
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names),
                      tensors=[tf.constant(values[k]) for k in names])


def test_an_entry_whose_dtype_changed_is_refused_not_restored(tmp_path):
    """The kernel's bytes reinterpreted as int32 (same size, CRC matching): the newest checkpoint is refused with a
    warning naming the dtype, and the one before it is resumed."""
    d = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(d, save_freq=5), StopAfter(10)])
    (newest, newest_prefix), (_, older) = list_checkpoints(d)[:2]
    _rewrite_with(newest_prefix, KERNEL, lambda a: a.view(np.int32))
    assert tf.train.load_checkpoint(newest_prefix).get_variable_to_dtype_map()[KERNEL] == tf.int32
    ckpt = ks.ChiefCheckpoint(d, save_freq=5)
    with pytest.warns(RuntimeWarning, match=r"dtype int32 there"):
        fit(make_model(), [ckpt, StopAfter(11)])
    assert ckpt.restored_from == older


def test_standard_tensorflow_tools_read_sync_and_async_checkpoints(tmp_path):
    for async_save in (False, True):
        d = str(tmp_path / f"ckpt_{async_save}")
        model = make_model()
        fit(model, [ks.ChiefCheckpoint(d, save_freq=3, async_save=async_save)], epochs=1)
        latest = tf.train.latest_checkpoint(d)
        assert latest == list_checkpoints(d)[0][1]
        names = dict(tf.train.list_variables(latest))
        assert names[KERNEL] == [4, 8] and "_CHECKPOINTABLE_OBJECT_GRAPH" in names
        np.testing.assert_array_equal(tf.train.load_checkpoint(latest).get_tensor(KERNEL), model.variables[0].numpy())
        # tf.train.Checkpoint.read with the same structure: every object matched
        fresh = make_model()
        target = tf.train.Checkpoint(model_variables=[v.value for v in fresh.variables])
        target.read(latest).expect_partial().assert_existing_objects_matched()
        for a, b in zip(weights(fresh), weights(model)):
            np.testing.assert_array_equal(a, b)


def test_an_array_a_reader_holds_never_changes_when_training_goes_on(tmp_path):
    """An evaluator reads the newest checkpoint while training rotates (max_to_keep=1, a save every batch): what it
    holds keeps the bytes it read, and a reader opened on the retired checkpoint still reads it (deleted, not
    recycled)."""
    d = str(tmp_path / "ckpt")
    model = make_model()
    fit(model, [ks.ChiefCheckpoint(d, save_freq=1, max_to_keep=1), StopAfter(3)])
    _, prefix = list_checkpoints(d)[0]
    reader, opened = read_checkpoint(prefix), read_checkpoint(prefix)
    held = reader.get_tensor(KERNEL)
    copy = held.copy()
    fit(make_model(), [ks.ChiefCheckpoint(d, save_freq=1, max_to_keep=1), StopAfter(12)])
    assert not os.path.exists(prefix + ".index")  # rotated out
    np.testing.assert_array_equal(held, copy)
    np.testing.assert_array_equal(opened.get_tensor(KERNEL), copy)  # opened before, read after the deletion
    assert list_checkpoints(d)[0][0] == 12


def test_tensorflow_written_checkpoints_are_resumed_by_sync_saves(tmp_path):
    d = str(tmp_path / "ckpt")
    reference = make_model()
    fit(reference, [])
    first = make_model()
    fit(first, [ks.ChiefCheckpoint(d, save_freq=2, async_save=True), StopAfter(13)])
    newest = list_checkpoints(d)[0][1]
    resumed = make_model()
    ckpt = ks.ChiefCheckpoint(d, save_freq=2)
    fit(resumed, [ckpt])
    assert ckpt.restored_from == newest
    for a, b in zip(weights(resumed), weights(reference)):
        np.testing.assert_array_equal(a, b)


def test_a_checkpoint_of_an_earlier_version_is_still_read(tmp_path):
    """Synchronous saves of earlier keras_scale versions (raw bytes + a JSON index) still resume, CRC-checked."""
    value = np.arange(6, dtype="float32").reshape(2, 3)
    prefix = str(tmp_path / "ckpt-1")
    raw = value.tobytes()
    with open(prefix + io.DATA_SUFFIX, "wb") as f:
        f.write(raw)
    index = {"format": io.LEGACY_FORMAT, "data_bytes": len(raw), "strings": {},
             "tensors": {"w/0/.ATTRIBUTES/VARIABLE_VALUE": {"dtype": "float32", "shape": [2, 3], "offset": 0,
                                                             "nbytes": len(raw), "crc32": zlib.crc32(raw)}}}
    with open(prefix + ".index", "w") as f:
        json.dump(index, f)
    target = tf.Variable(tf.zeros((2, 3)))
    io.read_into(prefix, {"w/0/.ATTRIBUTES/VARIABLE_VALUE": target})
    np.testing.assert_array_equal(target.numpy(), value)
    with open(prefix + io.DATA_SUFFIX, "r+b") as f:
        f.write(b"\xff")
    with pytest.raises(io.CorruptCheckpointError, match="CRC"):
        read_checkpoint(prefix).get_tensor("w/0/.ATTRIBUTES/VARIABLE_VALUE")


def test_orphans_of_killed_writes_are_removed_and_nothing_else(tmp_path):
    d = tmp_path / "ckpt"
    fit(make_model(), [ks.ChiefCheckpoint(str(d), save_freq=5, max_to_keep=2), StopAfter(10)])
    listed = {n for n, _ in list_checkpoints(str(d))}
    assert listed == {5, 10}
    planted = ["ckpt-3.data-00000-of-00001",                      # data whose index is gone
               "ckpt-15.index", "ckpt-15.data-00000-of-00001",    # complete, never recorded (newer than listed)
               "ckpt-12.data-00000-of-00001.tempstate123456",     # a write killed mid-way
               "ckpt-12.index.tempstate99", ".ks_spare_abc", "checkpoint.tmp" + "0" * 32,
               "checkpoint.tmp-123-0123456789ab"]
    kept = ["notes.txt", "ckpt-backup.index", "my-ckpt-3.data-00000-of-00001", "checkpoint.tmp", "checkpoint.bak"]  # not ours: never touched
    for name in planted + kept:
        (d / name).write_bytes(b"x" * 100)
    (d / "ckpt-20_temp").mkdir()
    fit(make_model(), [ks.ChiefCheckpoint(str(d), save_freq=5, max_to_keep=2), StopAfter(12)])
    names = set(os.listdir(d))
    assert not names & set(planted + ["ckpt-20_temp"]), sorted(names)
    assert set(kept) <= names
    assert {n for n, _ in list_checkpoints(str(d))} == {10, 12}


def test_a_kill_during_rotation_leaves_no_false_missing_index_warning(tmp_path, monkeypatch):
    """Retired checkpoints are deleted only after the state file stopped naming them: a kill in between leaves an
    unlisted checkpoint (an orphan), never a listed one without its files."""
    d = str(tmp_path / "ckpt")
    seen = []
    original = io.delete_checkpoint

    def watch(prefix):
        state = tf.train.get_checkpoint_state(d)
        seen.append((os.path.basename(prefix), [os.path.basename(p) for p in state.all_model_checkpoint_paths]))
        original(prefix)

    monkeypatch.setattr(io, "delete_checkpoint", watch)
    fit(make_model(), [ks.ChiefCheckpoint(d, save_freq=2, max_to_keep=1), StopAfter(6)])
    assert seen and all(name not in listed for name, listed in seen), seen


def _model_with_dropout():
    keras.utils.set_random_seed(11)
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dropout(0.3),
                          keras.layers.Dense(1)])
    m.compile(optimizer="adam", loss="mse")
    return m


def test_ks_load_checkpoint_maps_variables_by_path(tmp_path):
    """A Dropout's seed state sits between the layers' weights; a model built in a process that built other models
    first has other automatic names (dense_5, ...): the weights still land where they belong."""
    d = str(tmp_path / "ckpt")
    trained = _model_with_dropout()
    fit(trained, [ks.ChiefCheckpoint(d, save_freq=4)], epochs=1)
    for _ in range(2):
        keras.layers.Dense(3)  # shifts Keras's automatic layer numbering
    fresh = _model_with_dropout()
    assert [v.path for v in fresh.variables] != [v.path for v in trained.variables]
    prefix = ks.load_checkpoint(fresh, d)
    assert prefix == list_checkpoints(d)[0][1]
    for v, w in zip(fresh.trainable_variables, trained.trainable_variables):
        np.testing.assert_array_equal(v.numpy(), w.numpy())
    wider = keras.Sequential([keras.Input((4,)), keras.layers.Dense(9), keras.layers.Dropout(0.3), keras.layers.Dense(1)])
    with pytest.raises(ks.CheckpointMismatchError, match=r"float32\(4, 8\) there .* float32\(4, 9\) here"):
        ks.load_checkpoint(wider, d)
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    with pytest.raises(ks.CheckpointMismatchError, match="do not match by path"):
        ks.load_checkpoint(other, d)


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "keras_scale", "checkpoint", *args], capture_output=True, text=True,
                          env=subprocess_env(), cwd=cwd or REPO_ROOT, timeout=300)


@pytest.mark.slow
def test_checkpoint_cli_lists_and_exports(tmp_path):
    d = str(tmp_path / "ckpt")
    trained = make_model()
    ckpt = ks.ChiefCheckpoint(d, save_freq=5, keep_best_k=1, monitor="loss")
    fit(trained, [ckpt], epochs=2)
    out = _cli("ls", d)
    assert out.returncode == 0, out.stderr
    assert "ckpt-20" in out.stdout and "the completed run's final state" in out.stdout and "best: ckpt-" in out.stdout
    (tmp_path / "factory.py").write_text(
        "import keras\n"
        "def make():\n"
        "    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation='relu'),"
        " keras.layers.Dense(1)])\n")
    target = str(tmp_path / "model.weights.h5")
    out = _cli("export", d, "--step", "10", "--model", "factory:make", "--to", target, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    model = make_model()
    model.load_weights(target)
    reader = read_checkpoint(os.path.join(d, "ckpt-10"))
    np.testing.assert_array_equal(model.variables[0].numpy(), reader.get_tensor(KERNEL))
    out = _cli("export", d, "--model", "factory:make", "--to", str(tmp_path / "model.keras"), cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    loaded = keras.saving.load_model(str(tmp_path / "model.keras"))
    np.testing.assert_array_equal(loaded.variables[0].numpy(), trained.variables[0].numpy())


def test_checkpoint_cli_help_and_bad_usage_import_no_tensorflow(tmp_path):
    probe = ("import sys; from keras_scale_cli import main\n"
             "try:\n    main(['checkpoint', '--help'])\nexcept SystemExit:\n    pass\n"
             "print('TF' if 'tensorflow' in sys.modules or 'keras' in sys.modules else 'NO-TF')\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=subprocess_env(),
                         cwd=REPO_ROOT, timeout=120)
    assert "usage: keras-scale checkpoint" in out.stdout and out.stdout.strip().endswith("NO-TF"), out
    bad = _cli("export", str(tmp_path), "--model", "x:y", "--to", "model.h5")
    assert bad.returncode == 2 and ".weights.h5 or .keras" in bad.stderr


def test_ks_load_checkpoint_into_a_functional_model_with_batchnorm_and_two_outputs(tmp_path):
    def make():
        keras.utils.set_random_seed(5)
        i = keras.Input((4,))
        h = keras.layers.Dropout(0.2)(keras.layers.BatchNormalization()(keras.layers.Dense(8)(i)))
        m = keras.Model(i, [keras.layers.Dense(1)(h), keras.layers.Dense(2)(h)])
        m.compile("adam", ["mse", "mse"], loss_weights=[1.0, 0.5])
        return m

    d = str(tmp_path / "ckpt")
    x = np.random.RandomState(2).rand(32, 4).astype("float32")
    trained = make()
    trained.fit(x, [x[:, :1], x[:, :2]], batch_size=8, epochs=1, verbose=0, callbacks=[ks.ChiefCheckpoint(d)])
    fresh = make()  # other automatic names (dense_4, batch_normalization_1, ...)
    assert [v.path for v in fresh.variables] != [v.path for v in trained.variables]
    ks.load_checkpoint(fresh, d)
    for v, w in zip(fresh.variables, trained.variables):  # moving mean/variance and the seed state included
        np.testing.assert_array_equal(v.numpy(), w.numpy())
