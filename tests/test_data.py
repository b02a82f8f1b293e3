"""keras_scale.data: each lint fires on a bad pipeline and stays silent on the fixed one; optimize() keeps the
elements and their order; benchmark() counts what it timed. Every dataset here is real and built in the test."""
import warnings

import numpy as np
import pytest
import tensorflow as tf

import keras_scale
from keras_scale import data

AUTOTUNE = tf.data.AUTOTUNE


def codes(dataset, **kwargs):
    return [f.code for f in data.check(dataset, warn=False, **kwargs)]


def finding(dataset, code, **kwargs):
    found = [f for f in data.check(dataset, warn=False, **kwargs) if f.code == code]
    assert len(found) == 1, f"expected one {code!r} finding, got {found}"
    return found[0]


def heavy(x):
    """A graph-native, deterministic map with many ops (no Python, no state)."""
    v = tf.cast(tf.range(64), tf.float32) + tf.cast(x, tf.float32)
    for _ in range(10):
        v = tf.math.cumsum(tf.sin(v))
    return v


def good_pipeline():
    return (tf.data.Dataset.range(64).shuffle(64, seed=1).map(heavy, num_parallel_calls=AUTOTUNE)
            .cache().batch(8, drop_remainder=True).prefetch(AUTOTUNE))


def test_reachable_from_package():
    assert keras_scale.data is data


def test_good_pipeline_is_silent_under_strategy_and_xla():
    with warnings.catch_warnings():
        warnings.simplefilter("error", data.PipelineWarning)
        assert data.check(good_pipeline(), num_replicas=8, jit_compile=True) == []


# -- no prefetch ---------------------------------------------------------------------------------------------


def test_no_prefetch_fires_and_names_last_op():
    f = finding(tf.data.Dataset.range(10).batch(2), "no_prefetch")
    assert f.severity == "warning" and "BatchDatasetV2" in f.message and "prefetch(tf.data.AUTOTUNE)" in f.fix


def test_prefetch_at_the_end_is_silent_even_behind_options():
    options = tf.data.Options()
    options.threading.private_threadpool_size = 2
    ds = tf.data.Dataset.range(10).batch(2).prefetch(AUTOTUNE).with_options(options)
    assert "no_prefetch" not in codes(ds)


def test_prefetch_in_the_middle_does_not_count():
    ds = tf.data.Dataset.range(10).prefetch(2).batch(2)
    assert "no_prefetch" in codes(ds)


# -- sequential map ------------------------------------------------------------------------------------------


def test_sequential_map_built_synchronous_warns():
    ds = tf.data.Dataset.range(10).map(lambda x: x * 2, synchronous=True).prefetch(1)
    f = finding(ds, "sequential_map")
    assert f.severity == "warning" and "synchronous=True" in f.message and "num_parallel_calls" in f.fix


def test_sequential_stateful_map_warns():
    ds = tf.data.Dataset.range(10).map(lambda x: tf.cast(x, tf.float32) + tf.random.uniform(())).prefetch(1)
    f = finding(ds, "sequential_map")
    assert f.severity == "warning" and "RandomUniform" in f.message


def test_sequential_stateless_map_is_info_because_tf_parallelizes_it():
    mean = tf.constant(np.arange(4, dtype=np.float32))  # a captured tensor does not stop TF's rewrite
    ds = tf.data.Dataset.range(10).map(lambda x: tf.cast(x, tf.float32) - mean).prefetch(1)
    assert finding(ds, "sequential_map").severity == "info"
    with warnings.catch_warnings():
        warnings.simplefilter("error", data.PipelineWarning)
        data.check(ds)  # info findings are returned, not warned


def test_sequential_map_warns_when_options_turn_parallelization_off():
    options = tf.data.Options()
    options.experimental_optimization.map_parallelization = False
    ds = tf.data.Dataset.range(10).map(lambda x: x * 2).prefetch(1).with_options(options)
    f = finding(ds, "sequential_map")
    assert f.severity == "warning" and "map_parallelization is turned off" in f.message


def test_parallel_map_is_silent_and_num_parallel_calls_1_is_not():
    assert "sequential_map" not in codes(tf.data.Dataset.range(10).map(lambda x: x + 1, num_parallel_calls=AUTOTUNE))
    assert finding(tf.data.Dataset.range(10).map(lambda x: x + 1, num_parallel_calls=1),
                   "sequential_map").severity == "warning"


# -- Python inside map ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("wrapper", ["py_function", "numpy_function"])
def test_python_in_map_fires(wrapper):
    call = getattr(tf, wrapper)
    ds = tf.data.Dataset.range(10).map(lambda x: call(lambda v: v * 2, [x], tf.int64), num_parallel_calls=AUTOTUNE)
    f = finding(ds, "py_function")
    assert f.severity == "warning" and "GIL" in f.message


def test_python_nested_in_a_called_function_is_found():
    @tf.function
    def inner(x):
        return tf.py_function(lambda v: v + 1, [x], tf.int64)

    ds = tf.data.Dataset.range(10).map(lambda x: inner(x) * 2, num_parallel_calls=AUTOTUNE)
    assert "py_function" in codes(ds)


def test_python_generator_source_is_found():
    ds = tf.data.Dataset.from_generator(lambda: iter(range(5)), output_signature=tf.TensorSpec((), tf.int64))
    assert "from_generator" in finding(ds.prefetch(1), "py_function").message


def test_graph_native_map_has_no_python_finding():
    assert "py_function" not in codes(tf.data.Dataset.range(10).map(heavy, num_parallel_calls=AUTOTUNE))


# -- batch remainder -----------------------------------------------------------------------------------------


def test_batch_remainder_fires_with_replicas_or_xla():
    ds = tf.data.Dataset.range(10).batch(4).prefetch(1)
    f = finding(ds, "batch_remainder", num_replicas=2)
    assert "10 elements, 2 left over" in f.message and "drop_remainder=True" in f.fix
    assert "XLA" in finding(ds, "batch_remainder", num_replicas=1, jit_compile=True).message


def test_batch_remainder_silent_when_single_replica_dropped_or_divisible():
    assert "batch_remainder" not in codes(tf.data.Dataset.range(10).batch(4), num_replicas=1)
    assert "batch_remainder" not in codes(tf.data.Dataset.range(10).batch(4, drop_remainder=True), num_replicas=2)
    assert "batch_remainder" not in codes(tf.data.Dataset.range(12).batch(4), num_replicas=2, jit_compile=True)


def test_batch_remainder_defaults_to_the_active_strategy(mirrored):
    ds = tf.data.Dataset.range(10).batch(4)
    assert "batch_remainder" not in codes(ds)
    with mirrored.scope():
        assert "batch_remainder" in codes(ds)


def test_padded_batch_is_checked_too():
    ds = tf.data.Dataset.range(10).map(lambda x: tf.fill([x], x), num_parallel_calls=AUTOTUNE).padded_batch(4)
    assert "batch_remainder" in codes(ds, num_replicas=2)


# -- cache ---------------------------------------------------------------------------------------------------


def test_cache_missing_fires_on_small_expensive_map():
    ds = tf.data.Dataset.range(64).map(heavy, num_parallel_calls=AUTOTUNE).batch(8).prefetch(1)
    f = finding(ds, "cache_missing")
    assert "64 elements" in f.message and ".cache()" in f.fix


def test_cache_missing_fires_on_image_decoding():
    png = tf.io.encode_png(tf.zeros([16, 16, 3], tf.uint8))
    ds = (tf.data.Dataset.from_tensors(png).repeat(32)
          .map(lambda s: tf.image.resize(tf.io.decode_png(s, channels=3), [8, 8]), num_parallel_calls=AUTOTUNE)
          .batch(8).prefetch(1))
    assert "DecodePng" in finding(ds, "cache_missing").message


def test_cache_missing_silent_when_cached_cheap_large_or_random():
    cached = tf.data.Dataset.range(64).map(heavy, num_parallel_calls=AUTOTUNE).cache().batch(8).prefetch(1)
    cheap = tf.data.Dataset.range(64).map(lambda x: x + 1, num_parallel_calls=AUTOTUNE).batch(8).prefetch(1)
    large = tf.data.Dataset.range(64).map(heavy, num_parallel_calls=AUTOTUNE)
    random = tf.data.Dataset.range(64).map(lambda x: heavy(x) * tf.random.uniform(()), num_parallel_calls=AUTOTUNE)
    assert "cache_missing" not in codes(cached)
    assert "cache_missing" not in codes(cheap)
    assert "cache_missing" not in codes(large, cache_max_bytes=64 * 256 - 1)  # 64 x 64 float32 = 16 KiB
    assert "cache_missing" in codes(large, cache_max_bytes=64 * 256)
    assert "cache_missing" not in codes(random)  # caching would freeze the augmentation


def test_cache_before_the_map_does_not_count():
    ds = tf.data.Dataset.range(64).cache().map(heavy, num_parallel_calls=AUTOTUNE)
    assert "cache_missing" in codes(ds)


# -- in-memory cache larger than the budget ------------------------------------------------------------------


def test_large_memory_cache_fires_for_big_or_infinite_input():
    big = tf.data.Dataset.range(1000).map(lambda x: tf.zeros([256]), num_parallel_calls=AUTOTUNE).cache()
    f = finding(big, "large_memory_cache", cache_max_bytes=1000 * 256 * 4 - 1)
    assert "1000 elements" in f.message and "cache('/" in f.fix
    assert "without bound" in finding(tf.data.Dataset.range(10).repeat().cache(), "large_memory_cache").message


def test_large_memory_cache_silent_within_budget_or_on_disk(tmp_path):
    big = tf.data.Dataset.range(1000).map(lambda x: tf.zeros([256]), num_parallel_calls=AUTOTUNE)
    assert "large_memory_cache" not in codes(big.cache(), cache_max_bytes=1000 * 256 * 4)
    assert "large_memory_cache" not in codes(big.cache(str(tmp_path / "c")), cache_max_bytes=1)
    assert "large_memory_cache" not in codes(tf.data.Dataset.range(10).cache().repeat())


# -- shuffle buffer ------------------------------------------------------------------------------------------


def test_small_shuffle_buffer_fires_with_the_numbers():
    f = finding(tf.data.Dataset.range(5000).shuffle(4), "small_shuffle_buffer")
    assert "5000 elements through a buffer of 4" in f.message and ".shuffle(5000)" in f.fix


def test_shuffle_buffer_silent_when_large_enough_or_size_unknown():
    assert "small_shuffle_buffer" not in codes(tf.data.Dataset.range(5000).shuffle(5000))
    assert "small_shuffle_buffer" not in codes(tf.data.Dataset.range(5000).shuffle(50))  # 1 %
    assert "small_shuffle_buffer" not in codes(tf.data.Dataset.range(5000).repeat().shuffle(4))  # infinite input
    filtered = tf.data.Dataset.range(5000).filter(lambda x: x % 2 == 0).shuffle(4)  # unknown cardinality
    assert "small_shuffle_buffer" not in codes(filtered)


def test_shuffle_and_repeat_counts_the_elements_before_repeat():
    ds = tf.data.Dataset.range(5000).shuffle(4).repeat()
    assert "small_shuffle_buffer" in codes(ds)


# -- the warnings and bad input ------------------------------------------------------------------------------


def test_check_warns_for_each_warning_finding():
    ds = tf.data.Dataset.range(5000).shuffle(4).batch(3)
    with pytest.warns(data.PipelineWarning) as record:
        found = data.check(ds, num_replicas=2)
    warned = sorted(str(w.message) for w in record)
    assert len(warned) == len([f for f in found if f.severity == "warning"]) == 3
    assert any("small_shuffle_buffer" in w for w in warned)


def test_bad_input_is_rejected_with_the_value():
    with pytest.raises(TypeError, match="numpy.ndarray"):
        data.check(np.zeros(3))
    with pytest.raises(ValueError, match="num_replicas .* got 0"):
        data.check(tf.data.Dataset.range(3), num_replicas=0)
    with pytest.raises(ValueError, match="num_steps .* got 0"):
        data.benchmark(tf.data.Dataset.range(3), num_steps=0)
    with pytest.raises(TypeError, match="expects a tf.data.Dataset, got builtins.list"):
        data.optimize([1, 2, 3])


# -- optimize ------------------------------------------------------------------------------------------------


def as_list(ds):
    return [tuple(np.asarray(x).ravel().tolist()) for x in ds.as_numpy_iterator()]


def map_ops(ds):
    return sorted(n.op for n in data.pipeline_graph(ds).node if "Map" in n.op)


def noisy(x):
    """Heavy map with a stateful random op that does not change the value (so outputs can be compared)."""
    return heavy(x) + 0.0 * tf.random.uniform(())


def test_optimize_stateless_map_pins_tf_rewrite_keeps_order_and_adds_prefetch():
    mean = tf.constant(np.linspace(0, 1, 64, dtype=np.float32))
    slow = tf.data.Dataset.range(37).map(lambda x: heavy(x) - mean).batch(5)
    fast, changes = data.optimize(slow)
    assert as_list(fast) == as_list(slow)
    assert any("map_parallelization=True" in c for c in changes)
    assert any(c.startswith("appended prefetch") for c in changes)
    assert fast.options().experimental_optimization.map_parallelization is True
    assert fast.options().deterministic is True
    after = {f.code: f.severity for f in data.check(fast, warn=False)}
    assert "no_prefetch" not in after and after["sequential_map"] == "info"


def test_optimize_reenables_parallelization_a_pipeline_turned_off():
    options = tf.data.Options()
    options.experimental_optimization.map_parallelization = False
    slow = tf.data.Dataset.range(20).map(lambda x: x * 3).with_options(options)
    assert finding(slow, "sequential_map").severity == "warning"
    fast, changes = data.optimize(slow)
    assert as_list(fast) == as_list(slow)
    assert finding(fast, "sequential_map").severity == "info"  # TF's rewrite applies again


def unseeded(build):
    """Build a pipeline with no global seed (conftest seeds every test, which counts as asking for determinism)."""
    tf.random.set_seed(None)
    try:
        return build()
    finally:
        keras_scale_seed()


def keras_scale_seed():
    import keras

    keras.utils.set_random_seed(1234)  # what tests/conftest.py sets for every test


def test_optimize_parallelizes_an_unseeded_random_map_by_default_and_keeps_order():
    slow = unseeded(lambda: tf.data.Dataset.range(37).map(noisy).batch(5))
    fast, changes = data.optimize(slow)
    assert map_ops(fast) == ["ParallelMapDatasetV2"]
    assert any(c.startswith("parallelized map 'MapDataset") for c in changes)
    assert as_list(fast) == as_list(slow)
    assert "sequential_map" in codes(slow) and "sequential_map" not in codes(fast)
    same, changes = data.optimize(slow, parallelize_random=False)
    assert map_ops(same) == ["MapDataset"]
    assert any(c.startswith("not changed") and "RandomUniform" in c and "parallelize_random=False" in c
               for c in changes)
    with pytest.raises(TypeError, match="parallelize_random must be None"):
        data.optimize(slow, parallelize_random="yes")


def seeded_draws(x):
    """Heavy work plus a seeded stateful draw whose value shows up in the output (reproducible only in order)."""
    return tf.reduce_sum(heavy(x)) + tf.random.uniform((), seed=7)


@pytest.mark.parametrize("asked", ["op_seed", "global_seed", "options"])
def test_optimize_keeps_random_draws_reproducible_where_the_user_asked(asked):
    fn = seeded_draws if asked == "op_seed" else (lambda x: tf.reduce_sum(heavy(x)) + tf.random.uniform(()))
    tf.random.set_seed(11 if asked == "global_seed" else None)
    try:
        slow = tf.data.Dataset.range(30).map(fn).batch(4)
    finally:
        keras_scale_seed()
    if asked == "options":
        options = tf.data.Options()
        options.deterministic = True
        slow = slow.with_options(options)
    fast, changes = data.optimize(slow)
    assert map_ops(fast) == ["MapDataset"]
    reason = {"op_seed": "seeded random ops", "global_seed": "seeded random ops",
              "options": "deterministic=True in your tf.data.Options"}[asked]
    assert any(c.startswith("not changed") and reason in c and "parallelize_random=True" in c for c in changes)
    if asked != "options":  # seeded: the same values as the pipeline as written, every epoch
        assert as_list(fast) == as_list(slow) == as_list(fast)
    forced, changes = data.optimize(slow, parallelize_random=True)  # the user overrides the guard explicitly
    assert map_ops(forced) == ["ParallelMapDatasetV2"]


def test_optimize_random_map_after_shuffle_keeps_the_elements():
    slow = tf.data.Dataset.range(40).shuffle(40, seed=3).map(lambda x: x + tf.cast(0.0 * tf.random.uniform(()), tf.int64))
    fast, changes = data.optimize(slow, parallelize_random=True)
    assert map_ops(fast) == ["ParallelMapDatasetV2"]
    assert any("permutation" in c for c in changes)
    epoch1, epoch2 = [int(x) for x in fast], [int(x) for x in fast]
    assert sorted(epoch1) == sorted(epoch2) == list(range(40))
    assert epoch1 != epoch2  # still reshuffled each epoch


def test_optimize_never_parallelizes_order_dependent_state():
    counter = tf.Variable(0, dtype=tf.int64)
    slow = tf.data.Dataset.range(6).map(lambda x: x + counter.assign_add(1))
    fast, changes = data.optimize(slow, parallelize_random=True)
    assert any(c.startswith("not changed") and "AssignAddVariableOp" in c for c in changes)
    assert [int(x) for x in fast] == [2 * i + 1 for i in range(6)]  # sequential, and the live variable


def test_optimize_does_not_rebuild_a_pipeline_that_reads_a_variable():
    scale = tf.Variable(2.0)
    slow = tf.data.Dataset.range(6).map(lambda x: tf.cast(x, tf.float32) * scale + 0.0 * tf.random.uniform(()))
    fast, changes = data.optimize(slow, parallelize_random=True)
    assert any(c.startswith("not changed") and "cannot be rebuilt" in c for c in changes)
    scale.assign(10.0)  # the optimized pipeline must still read the live variable
    assert [float(x) for x in fast] == [10.0 * i for i in range(6)]


def test_optimize_keeps_a_seeded_shuffle_and_user_determinism():
    slow = tf.data.Dataset.range(40).shuffle(40, seed=3, reshuffle_each_iteration=False).batch(4)
    fast, _ = data.optimize(slow)
    assert as_list(fast) == as_list(slow)
    options = tf.data.Options()
    options.deterministic = False
    _, changes = data.optimize(slow.with_options(options))
    assert any("deterministic=False" in c for c in changes)


def test_optimize_does_not_add_a_second_prefetch():
    _, changes = data.optimize(tf.data.Dataset.range(4).prefetch(2))
    assert not any("prefetch" in c for c in changes)


# -- benchmark -----------------------------------------------------------------------------------------------


def test_benchmark_counts_batches_and_samples():
    result = data.benchmark(tf.data.Dataset.range(1000).batch(10), num_steps=30, warmup_steps=3)
    assert (result.num_steps, result.num_samples, result.warmup_steps) == (30, 300, 3)
    assert result.elapsed_s > 0 and result.batches_per_s > 0
    assert result.samples_per_s == pytest.approx(10 * result.batches_per_s)


def test_benchmark_on_short_dataset_times_what_exists():
    result = data.benchmark(tf.data.Dataset.range(25).batch(10), num_steps=100, warmup_steps=1)
    assert (result.num_steps, result.num_samples) == (2, 15)  # batches of 10 and 5 after one warm-up batch
    with pytest.raises(ValueError, match="ran out during the 3 warm-up"):
        data.benchmark(tf.data.Dataset.range(25).batch(10), num_steps=5, warmup_steps=5)


def test_benchmark_sees_a_slower_pipeline_as_slower():
    # Not a timing assertion on absolute numbers: the same pipeline with ~20x more work per element.
    light = tf.data.Dataset.range(200).map(lambda x: tf.reduce_sum(tf.sort(tf.random.stateless_uniform([64], [x, x])))).batch(10)
    heavy_ds = tf.data.Dataset.range(200).map(lambda x: tf.reduce_sum(tf.sort(tf.random.stateless_uniform([200_000], [x, x])))).batch(10)
    fast = data.benchmark(light, num_steps=10, warmup_steps=2)
    slow = data.benchmark(heavy_ds, num_steps=10, warmup_steps=2)
    assert slow.batches_per_s < fast.batches_per_s


def test_optimized_dataset_trains_under_mirrored_strategy(mirrored):
    import keras

    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(32, 2)
    y = x.sum(axis=1, keepdims=True)
    slow = (tf.data.Dataset.from_tensor_slices((x, y))
            .map(lambda a, b: (a + 0.0 * tf.random.uniform(()), b)).batch(8, drop_remainder=True))
    fast, changes = data.optimize(slow, parallelize_random=True)
    assert any(c.startswith("parallelized map") for c in changes)
    with mirrored.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    history = model.fit(fast, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


# -- the lint table and the order of findings ----------------------------------------------------------------


def test_findings_come_grouped_in_the_documented_order():
    ds = tf.data.Dataset.range(5000).shuffle(4).map(lambda x: tf.py_function(lambda v: v, [x], tf.int64)).batch(3)
    found = codes(ds, num_replicas=2)
    assert found == ["no_prefetch", "sequential_map", "py_function", "batch_remainder", "small_shuffle_buffer"]


def test_docs_table_lists_every_lint_rule_in_report_order():
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[1] / "docs" / "data.md").read_text()
    documented = re.findall(r"^\| `(\w+)` \|", text, flags=re.M)
    rules = [rule.__name__.replace("_lint_", "", 1) for rule in data._LINT_RULES]
    assert documented == rules
    assert all(f"``{code}``" in data.Finding.__doc__ for code in rules)


# -- reading the dataset objects (what ks.fit asks before batching / sharding) --------------------------------


def test_dataset_is_batched_follows_the_outermost_batch_or_unbatch():
    x = np.zeros((64, 2), np.float32)
    unbatched = tf.data.Dataset.from_tensor_slices((x, x))
    assert not data.dataset_is_batched(unbatched)
    assert data.dataset_is_batched(unbatched.batch(5))
    assert data.dataset_is_batched(tf.data.Dataset.range(4).batch(2).map(lambda v: v).prefetch(1))
    assert not data.dataset_is_batched(tf.data.Dataset.range(4).batch(2).unbatch())
    assert data.dataset_is_batched(tf.data.Dataset.range(8).batch(2).unbatch().batch(3))
    assert data.dataset_is_batched(tf.data.Dataset.range(8).padded_batch(2).with_options(tf.data.Options()))
    assert data.dataset_is_batched(tf.data.Dataset.range(8).batch(2, num_parallel_calls=AUTOTUNE))
    assert data.dataset_is_batched(tf.data.Dataset.range(8).batch(4).rebatch(2))
    assert not data.dataset_is_batched(tf.data.Dataset.range(8).shuffle(8).repeat(2))


def test_dataset_readers_do_not_serialize_the_graph(monkeypatch):
    # ks.fit asks these on every call: serializing would copy in-memory arrays into the graph (> 2 GB fails)
    ds = tf.data.Dataset.from_tensor_slices(np.zeros((64, 2), np.float32)).batch(8).prefetch(1)

    def refuse(*args, **kwargs):
        raise AssertionError("the dataset graph was serialized")

    monkeypatch.setattr(tf.data.Dataset, "_as_serialized_graph", refuse)
    assert data.dataset_chain(ds) == ["PrefetchDataset", "BatchDataset", "TensorSliceDataset"]
    assert data.dataset_is_batched(ds) and not data.dataset_is_file_based(ds)


def test_pipeline_stages_reach_every_stage_once_and_the_main_chain_stops_at_a_zip():
    # the fingerprint of a saved data position and the seeded-reshuffle check read every stage through this walk
    def kinds(dataset, **kw):
        return [data._kind(type(s).__name__) for s in data.pipeline_stages(dataset, **kw)]

    shared = tf.data.Dataset.range(4).map(lambda v: v)
    assert kinds(tf.data.Dataset.zip(shared, shared)) == ["ZipDataset", "MapDataset", "RangeDataset"]
    joined = tf.data.Dataset.range(3).shuffle(3, seed=1).concatenate(tf.data.Dataset.range(2).take(1)).batch(2)
    assert kinds(joined) == ["BatchDataset", "ConcatenateDataset", "TakeDataset", "RangeDataset", "ShuffleDataset",
                             "RangeDataset"]
    assert kinds(joined, follow=data.MAIN_CHAIN) == ["BatchDataset", "ConcatenateDataset", "ShuffleDataset",
                                                      "RangeDataset"]  # a concatenate's first side
    assert kinds(tf.data.Dataset.zip(shared, shared).batch(2), follow=data.MAIN_CHAIN) == ["BatchDataset",
                                                                                           "ZipDataset"]
    assert kinds(joined, follow=("_input_dataset", "_input_datasets")) == kinds(joined)
    other = object()  # e.g. a distributed dataset: itself, no inputs read
    assert list(data.pipeline_stages(other)) == [other] and list(data.pipeline_stages(None)) == []


def test_dataset_is_file_based_sees_file_readers_and_interleave(tmp_path):
    path = str(tmp_path / "a.tfrecord")
    with tf.io.TFRecordWriter(path) as w:
        w.write(b"x")
    files = tf.data.Dataset.list_files(str(tmp_path / "*.tfrecord")).interleave(tf.data.TFRecordDataset)
    assert data.dataset_is_file_based(files.batch(2).prefetch(1))
    assert data.dataset_is_file_based(tf.data.TextLineDataset([path]))
    assert not data.dataset_is_file_based(tf.data.Dataset.range(3).map(lambda v: v).batch(2))
