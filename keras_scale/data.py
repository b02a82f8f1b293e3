"""Input-pipeline tools: lint a ``tf.data`` pipeline (:func:`check`), time it alone (:func:`benchmark`) and
apply the safe fixes (:func:`optimize`).

All three read the dataset's own serialized graph (``GraphDef`` of dataset ops plus the ``FunctionDef`` library
of their map/filter/interleave functions), not the Python objects that built it, so they see what TensorFlow
will run: the ops inside ``map`` functions, the constants given to ``batch``/``shuffle``/``prefetch`` and the
``tf.data.Options`` attached anywhere in the pipeline. The lint is a table of small rule functions
(``_LINT_RULES``), one per :class:`Finding` code, run over facts gathered once.

:func:`dataset_is_batched` and :func:`dataset_is_file_based` (what ``keras_scale.fit`` asks before batching
and sharding) read the Python dataset objects instead, in the same op vocabulary: serializing the graph would
copy every in-memory array into it.

Example:
    >>> import tensorflow as tf
    >>> from keras_scale import data
    >>> ds = tf.data.Dataset.range(1000).map(lambda x: x * 2).batch(32)
    >>> [f.code for f in data.check(ds, warn=False)]
    ['no_prefetch', 'sequential_map']
    >>> fast, changes = data.optimize(ds)
    >>> data.benchmark(fast, num_steps=20).batches_per_s  # doctest: +SKIP
    4210.5
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import numpy as np
import tensorflow as tf

from keras_scale._validate import check_int
from tensorflow.core.framework import dataset_options_pb2
from tensorflow.python.framework import config as tf_config
from tensorflow.python.framework import op_def_registry

__all__ = ["Finding", "PipelineWarning", "BenchmarkResult", "check", "benchmark", "optimize", "pipeline_graph",
           "pipeline_stages", "MAIN_CHAIN"]

AUTOTUNE = -1  # tf.data.AUTOTUNE

# ------------------------------------------------------------------------------------------------------------
# Op families (names as they appear in the serialized graph; several versions of each op exist).
_PASS_THROUGH = {
    "OptionsDataset", "ModelDataset", "MaxIntraOpParallelismDataset", "PrivateThreadPoolDataset",
    "AssertCardinalityDataset", "AssertNextDataset", "AssertPrevDataset", "NonSerializableDataset",
    "ExperimentalMaxIntraOpParallelismDataset", "ExperimentalPrivateThreadPoolDataset",
}
_PREFETCH = {"PrefetchDataset"}
_SEQUENTIAL_MAP = {"MapDataset"}
_PARALLEL_MAP = {"ParallelMapDataset", "ParallelMapDatasetV2", "MapAndBatchDataset", "ExperimentalMapAndBatchDataset"}
_BATCH = {
    "BatchDataset", "BatchDatasetV2", "PaddedBatchDataset", "PaddedBatchDatasetV2", "ParallelBatchDataset",
    "MapAndBatchDataset", "ExperimentalMapAndBatchDataset", "DenseToSparseBatchDataset",
    "ExperimentalDenseToSparseBatchDataset",
}
_UNBATCH = {"UnbatchDataset", "ExperimentalUnbatchDataset"}
_SHUFFLE = {"ShuffleDataset", "ShuffleDatasetV2", "ShuffleDatasetV3", "ShuffleAndRepeatDataset",
            "ShuffleAndRepeatDatasetV2"}
_CACHE = {"CacheDataset", "CacheDatasetV2"}
_PY_FUNC = {"EagerPyFunc", "PyFunc", "PyFuncStateless"}
# Ops that make a map worth caching on their own: decoding, parsing, file reads, resizing, Python.
_EXPENSIVE_OPS = {
    "DecodeJpeg", "DecodePng", "DecodeImage", "DecodeBmp", "DecodeGif", "DecodeAndCropJpeg", "DecodeWav",
    "DecodeRaw", "DecodeCompressed", "DecodeCSV", "DecodeJSONExample", "DecodeProtoV2", "ParseExample",
    "ParseExampleV2", "ParseSingleExample", "ParseSequenceExample", "ParseSequenceExampleV2",
    "ParseSingleSequenceExample", "ParseTensor", "ReadFile", "ResizeBilinear", "ResizeBicubic", "ResizeArea",
    "ResizeNearestNeighbor", "ScaleAndTranslate", "CropAndResize", "AudioSpectrogram", "Mfcc", "RFFT", "FFT",
    "RFFT2D", "FFT2D",
} | _PY_FUNC
# Bookkeeping ops that cost nothing; everything else counts towards "expensive" by op count.
_TRIVIAL_OPS = {"Const", "Identity", "IdentityN", "NoOp", "Placeholder", "_Arg", "_Retval", "Shape", "Pack",
                "StopGradient", "Cast", "Reshape", "ExpandDims", "Squeeze", "StridedSlice"}
# Ops that call another function of the library by attr (the op itself is not the work).
_CALL_OPS = {"PartitionedCall", "StatefulPartitionedCall", "If", "StatelessIf", "While", "StatelessWhile",
             "Case", "StatelessCase"}
# Ops that are "stateful" by their registration but do not make a function's result depend on call order.
_HARMLESS_STATEFUL = {"Assert", "PrintV2", "Print"} | _CALL_OPS


def _kind(name: str) -> str:
    """The family of a dataset op or of the Python class that builds it, e.g. ``BatchDatasetV2`` (graph op),
    ``ExperimentalMapAndBatchDataset`` and ``_BatchDataset`` (Python class) -> ``BatchDataset`` and
    ``MapAndBatchDataset``: one vocabulary for both readers below."""
    base = name.lstrip("_").rstrip("0123456789")
    base = base[:-1] if base.endswith("V") else base
    return base[len("Experimental"):] if base.startswith("Experimental") else base


_BATCH_KINDS = frozenset(_kind(op) for op in _BATCH)
_UNBATCH_KINDS = frozenset(_kind(op) for op in _UNBATCH)
# Parts of a kind that mark a pipeline reading files (or interleaving sources), for tf.distribute's auto-sharding.
_FILE_KIND_PARTS = ("TFRecord", "TextLine", "FixedLengthRecord", "Interleave", "FlatMap")


def _is_random_op(op: str) -> bool:
    return op.startswith("Random") or op in {"TruncatedNormal", "Multinomial", "ParameterizedTruncatedNormal"}


class PipelineWarning(UserWarning):
    """Category of the warnings :func:`check` emits (filter with ``warnings.simplefilter(..., PipelineWarning)``).

    Example:
        >>> import warnings
        >>> warnings.simplefilter("error", PipelineWarning)  # make pipeline findings fatal in CI
    """


@dataclasses.dataclass(frozen=True)
class Finding:
    """One problem :func:`check` found in a ``tf.data`` pipeline, tied to a dataset op of its graph.

    Only problems are reported (a clean pipeline gives ``[]``). Not to be confused with
    ``keras_scale.doctor.CheckResult``, the verdict of one environment check of ``keras-scale doctor``, which
    exists for every check, passed or not (``ok``/``warn``/``error``/``skip``).

    Attributes:
        code: stable identifier, one of ``no_prefetch``, ``sequential_map``, ``py_function``,
            ``batch_remainder``, ``cache_missing``, ``large_memory_cache``, ``small_shuffle_buffer``.
        severity: ``"warning"`` (slows or breaks training) or ``"info"`` (TensorFlow already works around it at
            runtime, but being explicit is better).
        message: what is wrong, naming the dataset op and the values read from the graph.
        fix: what to change in the pipeline code.
        node: name of the dataset op in the serialized graph (e.g. ``"MapDataset/_9"``).

    Example:
        >>> f = Finding("no_prefetch", "warning", "pipeline ends with BatchDatasetV2",
        ...             "add .prefetch(tf.data.AUTOTUNE)")
        >>> print(f)
        [warning] no_prefetch: pipeline ends with BatchDatasetV2 Fix: add .prefetch(tf.data.AUTOTUNE)
    """

    code: str
    severity: str
    message: str
    fix: str
    node: Optional[str] = None

    def __str__(self) -> str:
        return f"[{self.severity}] {self.code}: {self.message} Fix: {self.fix}"


# ------------------------------------------------------------------------------------------------------------
# Reading the Python dataset objects: the cheap reader, for questions about the pipeline's outer structure.
# Serializing the graph (below) copies every in-memory tensor into it (a from_tensor_slices of 200 MB takes
# seconds; over 2 GB the proto cannot be written), so questions asked on every fit() walk the objects instead.


#: ``follow`` for :func:`pipeline_stages` along the main chain only (``_input_dataset``).
MAIN_CHAIN = ("_input_dataset",)


def pipeline_stages(dataset: Any, follow: Sequence[str] = ("_inputs",)) -> Iterator[tf.data.Dataset]:
    """Each stage of the ``tf.data`` pipeline that ends in ``dataset``, once, walking upstream: ``dataset`` first,
    then depth first towards the sources, a stage before its inputs and, of a stage's several inputs (``zip``,
    ``concatenate``), the last one's branch first. A stage reached along two paths comes once; ``None`` yields
    nothing.

    ``follow`` names where a stage's inputs are read, in that order: attributes holding a dataset or a list of
    datasets, or methods returning them. The default, TensorFlow's ``_inputs()``, reaches every stage (the
    components of a ``zip``, both sides of a ``concatenate``, a reader's inner datasets); :data:`MAIN_CHAIN`
    (``("_input_dataset",)``) walks only the main chain, which goes on through a ``concatenate`` along its first side
    and ends at a source or at a ``zip``, ``sample_from_datasets`` or ``choose_from_datasets``. Only
    ``tf.data.Dataset`` inputs are followed, and a stage whose inputs cannot be read (a method raising) counts as a
    source: ``dataset`` itself may be another object (a distributed dataset), yielded alone.

    Reads the Python dataset objects only (no graph serialization), so it is cheap on pipelines holding large
    in-memory arrays. A caller may stop early (``any(...)`` over the stages).

    Example:
        >>> both = tf.data.Dataset.zip(tf.data.Dataset.range(3), tf.data.Dataset.range(3).map(lambda v: v))
        >>> [_kind(type(s).__name__) for s in pipeline_stages(both.batch(2))]
        ['BatchDataset', 'ZipDataset', 'MapDataset', 'RangeDataset', 'RangeDataset']
        >>> [_kind(type(s).__name__) for s in pipeline_stages(both.batch(2), follow=MAIN_CHAIN)]
        ['BatchDataset', 'ZipDataset']
    """
    stack, seen = ([] if dataset is None else [dataset]), set()
    while stack:
        stage = stack.pop()
        if id(stage) in seen:
            continue
        seen.add(id(stage))
        yield stage
        stack.extend(_stage_inputs(stage, follow))


def _stage_inputs(stage: Any, follow: Sequence[str]) -> List[tf.data.Dataset]:
    """The datasets that ``stage`` reads, from its attributes (or methods) named in ``follow``."""
    found: List[tf.data.Dataset] = []
    for name in follow:
        try:
            value = getattr(stage, name, None)
            value = value() if callable(value) else value
        except Exception:  # noqa: BLE001 - a stage whose inputs cannot be read is a source here
            value = None
        if not isinstance(value, tf.data.Dataset) and isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, tf.data.Dataset))
        elif isinstance(value, tf.data.Dataset):
            found.append(value)
    return found


def dataset_chain(dataset: tf.data.Dataset) -> List[str]:
    """Kinds of the datasets from ``dataset`` back to its source along ``_input_dataset``, outermost first.

    Kinds are the op families :func:`check` reads from the graph (``"BatchDataset"``, ``"MapDataset"``, ...).
    A dataset with several inputs ends the chain (``zip``, ``sample_from_datasets``), except ``concatenate``: the
    chain goes on along its first side.

    Example:
        >>> dataset_chain(tf.data.Dataset.range(4).batch(2).prefetch(1))
        ['PrefetchDataset', 'BatchDataset', 'RangeDataset']
    """
    return [_kind(type(stage).__name__) for stage in itertools.islice(pipeline_stages(dataset, MAIN_CHAIN), 1000)]


def dataset_is_batched(dataset: tf.data.Dataset) -> bool:
    """Whether ``dataset`` yields batches: the outermost ``batch``-like step (``batch``, ``padded_batch``,
    ``map_and_batch``, ``sparse_batch``) is not undone by a later ``unbatch``. Reads the Python objects only
    (no graph serialization), so it is cheap on pipelines holding large in-memory arrays.

    Example:
        >>> dataset_is_batched(tf.data.Dataset.range(4).batch(2).map(lambda v: v).prefetch(1))
        True
        >>> dataset_is_batched(tf.data.Dataset.range(4).batch(2).unbatch())
        False
    """
    for kind in dataset_chain(dataset):
        if kind in _UNBATCH_KINDS:
            return False
        if kind in _BATCH_KINDS:
            return True
    return False


def dataset_is_file_based(dataset: tf.data.Dataset) -> bool:
    """Whether ``dataset`` reads files or interleaves sources (TFRecord/TextLine/FixedLengthRecord readers,
    ``interleave``, ``flat_map``) anywhere along its main chain: such pipelines can be auto-sharded by file.

    Example:
        >>> dataset_is_file_based(tf.data.Dataset.range(3).map(lambda v: v))
        False
    """
    return any(part in kind for kind in dataset_chain(dataset) for part in _FILE_KIND_PARTS)


# ------------------------------------------------------------------------------------------------------------
# Reading the graph: the full reader, for the lint and the rewrite (sees map functions, constants, options).


def _require_dataset(dataset: Any, fn: str) -> tf.data.Dataset:
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(
            f"keras_scale.data.{fn} expects a tf.data.Dataset, got {type(dataset).__module__}."
            f"{type(dataset).__qualname__}. Pass the dataset you give to model.fit (before "
            "strategy.experimental_distribute_dataset); wrap arrays with tf.data.Dataset.from_tensor_slices."
        )
    return dataset


def pipeline_graph(dataset: tf.data.Dataset) -> tf.compat.v1.GraphDef:
    """The dataset's serialized graph as a ``GraphDef`` (dataset ops as nodes, map functions in ``library``).

    Example:
        >>> g = pipeline_graph(tf.data.Dataset.range(4).batch(2))
        >>> [n.op for n in g.node if n.op.endswith("Dataset") or n.op.endswith("DatasetV2")]
        ['RangeDataset', 'BatchDatasetV2']
    """
    _require_dataset(dataset, "pipeline_graph")
    graph_def = tf.compat.v1.GraphDef()
    serialized = dataset._as_serialized_graph(  # pylint: disable=protected-access
        external_state_policy=tf.data.experimental.ExternalStatePolicy.IGNORE
    )
    graph_def.ParseFromString(serialized.numpy())
    return graph_def


def _clean(name: str) -> Optional[str]:
    if name.startswith("^"):
        return None  # control input
    return name.split(":")[0]


def _is_dataset_op(op: str) -> bool:
    return _kind(op).endswith("Dataset")


class _Pipeline:
    """Index over a dataset GraphDef: nodes, dataset edges, constants, functions and effective options."""

    def __init__(self, graph_def: tf.compat.v1.GraphDef):
        self.graph_def = graph_def
        self.nodes = {n.name: n for n in graph_def.node}
        self.functions = {f.signature.name: f for f in graph_def.library.function}
        retval = [n for n in graph_def.node if n.op == "_Retval"]
        self.sink = _clean(retval[0].input[0]) if retval else graph_def.node[-1].name
        self.consumers: Dict[str, List[str]] = {}
        for node in graph_def.node:
            for name in self.dataset_inputs(node):
                self.consumers.setdefault(name, []).append(node.name)
        self._fn_ops: Dict[str, Set[str]] = {}
        self._cardinality: Dict[str, Optional[int]] = {}

    # -- structure
    def dataset_nodes(self) -> List[Any]:
        return [n for n in self.graph_def.node if _is_dataset_op(n.op)]

    def dataset_inputs(self, node: Any) -> List[str]:
        out = []
        for raw in node.input:
            name = _clean(raw)
            if name is not None and name in self.nodes and _is_dataset_op(self.nodes[name].op):
                out.append(name)
        return out

    def named_inputs(self, node: Any) -> Dict[str, List[str]]:
        """Map the node's inputs to its op's argument names (``batch_size``, ``drop_remainder``, ...)."""
        inputs = [_clean(i) for i in node.input]
        inputs = [i for i in inputs if i is not None]
        op_def = op_def_registry.get(node.op)
        if op_def is None:
            return {}
        out, pos = {}, 0
        for arg in op_def.input_arg:
            if arg.number_attr:
                count = node.attr[arg.number_attr].i
            elif arg.type_list_attr:
                count = len(node.attr[arg.type_list_attr].list.type)
            else:
                count = 1
            out[arg.name] = inputs[pos:pos + count]
            pos += count
        return out

    def const(self, node: Any, arg: str) -> Any:
        """The constant fed to input ``arg`` of ``node`` (as a Python scalar), or ``None`` if not a constant."""
        names = self.named_inputs(node).get(arg) or []
        if len(names) != 1:
            return None
        source = self.nodes.get(names[0])
        while source is not None and source.op == "Identity" and source.input:
            source = self.nodes.get(_clean(source.input[0]) or "")
        if source is None or source.op != "Const" or source.attr["dtype"].type == tf.resource.as_datatype_enum:
            return None
        value = tf.make_ndarray(source.attr["value"].tensor)
        return value.item() if value.size == 1 else value

    def consumers_of(self, name: str) -> List[str]:
        """Names of all nodes (dataset or not) taking ``name`` as a data input."""
        return [n.name for n in self.graph_def.node if any(_clean(i) == name for i in n.input)]

    def downstream(self, name: str) -> List[Any]:
        """Dataset nodes fed (directly or not) by ``name``, nearest first."""
        seen, order, frontier = set(), [], [name]
        while frontier:
            nxt = []
            for n in frontier:
                for c in self.consumers.get(n, []):
                    if c not in seen:
                        seen.add(c)
                        order.append(self.nodes[c])
                        nxt.append(c)
            frontier = nxt
        return order

    def last_transformation(self) -> Any:
        node = self.nodes[self.sink]
        while node.op in _PASS_THROUGH and self.dataset_inputs(node):
            node = self.nodes[self.dataset_inputs(node)[0]]
        return node

    # -- functions
    def node_functions(self, node: Any) -> List[str]:
        names = []
        for value in node.attr.values():
            if value.HasField("func") and value.func.name:
                names.append(value.func.name)
            elif value.HasField("list"):
                names.extend(f.name for f in value.list.func if f.name)
        return names

    def function_ops(self, fn_name: str) -> Set[str]:
        """All op types run by library function ``fn_name``, following calls into nested functions."""
        if fn_name in self._fn_ops:
            return self._fn_ops[fn_name]
        self._fn_ops[fn_name] = set()  # guards recursion
        ops: Set[str] = set()
        fdef = self.functions.get(fn_name)
        if fdef is not None:
            for node in fdef.node_def:
                if node.op in self.functions:  # direct call to a library function
                    ops |= self.function_ops(node.op)
                    continue
                ops.add(node.op)
                for callee in self.node_functions(node):
                    ops |= self.function_ops(callee)
        self._fn_ops[fn_name] = ops
        return ops

    def function_node_count(self, fn_name: str, _seen: Optional[Set[str]] = None) -> int:
        seen = _seen if _seen is not None else set()
        if fn_name in seen:
            return 0
        seen.add(fn_name)
        fdef = self.functions.get(fn_name)
        if fdef is None:
            return 0
        count = 0
        for node in fdef.node_def:
            if node.op in self.functions:
                count += self.function_node_count(node.op, seen)
            elif node.op not in _TRIVIAL_OPS:
                count += 1
            for callee in self.node_functions(node):
                count += self.function_node_count(callee, seen)
        return count

    def ops_of(self, node: Any) -> Set[str]:
        ops: Set[str] = set()
        for fn in self.node_functions(node):
            ops |= self.function_ops(fn)
        return ops

    def stateful_ops(self, node: Any) -> List[str]:
        out = []
        for op in sorted(self.ops_of(node)):
            if op in _HARMLESS_STATEFUL:
                continue
            op_def = op_def_registry.get(op)
            if op_def is not None and op_def.is_stateful:
                out.append(op)
        return out

    def seeded_random_ops(self, node: Any) -> List[str]:
        """Stateful random ops in ``node``'s functions (nested calls followed) given a seed: an op-level
        ``seed=`` or a global ``tf.random.set_seed`` (either makes the graph's ``seed``/``seed2`` attrs non-zero).
        A sequential map draws such seeded numbers reproducibly; a parallel one would not."""
        seen: Set[str] = set()
        out: Set[str] = set()
        stack = list(self.node_functions(node))
        while stack:
            fn = stack.pop()
            if fn in seen or fn not in self.functions:
                continue
            seen.add(fn)
            for n in self.functions[fn].node_def:
                if n.op in self.functions:
                    stack.append(n.op)
                stack.extend(self.node_functions(n))
                if _is_random_op(n.op) and (n.attr["seed"].i or n.attr["seed2"].i):
                    out.add(n.op)
        return sorted(out)

    def captured_inputs(self, node: Any) -> List[str]:
        return self.named_inputs(node).get("other_arguments", [])

    # -- options
    def options(self) -> dataset_options_pb2.Options:
        """Effective ``tf.data.Options``: OptionsDataset nodes merged, those nearer the end winning."""
        merged = dataset_options_pb2.Options()
        chain = []
        visited = set()
        # Walk every OptionsDataset upstream of the sink; order them from source to sink.
        stack = [self.sink]
        while stack:
            name = stack.pop()
            if name in visited or name not in self.nodes:
                continue
            visited.add(name)
            node = self.nodes[name]
            if node.op == "OptionsDataset":
                chain.append(node)
            stack.extend(self.dataset_inputs(node))
        for node in reversed(chain):  # upstream first
            pb = dataset_options_pb2.Options()
            pb.ParseFromString(node.attr["serialized_options"].s)
            merged.MergeFrom(pb)
        return merged

    # -- cardinality, computed by TensorFlow on the sub-pipeline ending at `name`
    def cardinality(self, name: str) -> Optional[int]:
        """Number of elements produced by node ``name``; ``None`` if unknown, ``math.inf`` if infinite."""
        if name in self._cardinality:
            return self._cardinality[name]
        result: Optional[int] = None
        try:
            sub = tf.compat.v1.GraphDef()
            sub.CopyFrom(self.graph_def)
            for node in sub.node:
                if node.op == "_Retval":
                    node.input[0] = name
            variant = tf.raw_ops.DatasetFromGraph(graph_def=sub.SerializeToString())
            value = int(tf.raw_ops.DatasetCardinality(input_dataset=variant))
            result = math.inf if value == tf.data.INFINITE_CARDINALITY else (None if value < 0 else value)
        except Exception:  # noqa: BLE001 - a graph TF cannot rebuild here: cardinality unknown
            result = None
        self._cardinality[name] = result
        return result

    def element_bytes(self, node: Any) -> Optional[int]:
        """Bytes of one element of ``node``'s output, from its ``output_shapes``/``output_types`` attrs."""
        types = node.attr["output_types"].list.type
        shapes = node.attr["output_shapes"].list.shape
        if not types or len(types) != len(shapes):
            return None
        total = 0
        for dtype, shape in zip(types, shapes):
            dt = tf.dtypes.as_dtype(dtype)
            if dt in (tf.string, tf.variant, tf.resource) or shape.unknown_rank:
                return None
            dims = [d.size for d in shape.dim]
            if any(d < 0 for d in dims):
                return None
            total += int(np.prod(dims, dtype=np.int64)) * dt.size
        return total


def _default_num_replicas() -> int:
    try:
        return int(tf.distribute.get_strategy().num_replicas_in_sync)
    except Exception:  # noqa: BLE001
        return 1


def _map_fn_name(pipe: _Pipeline, node: Any) -> str:
    fns = pipe.node_functions(node)
    return fns[0] if fns else "?"


def _auto_parallel_blockers(pipe: _Pipeline, node: Any, opts: dataset_options_pb2.Options) -> List[str]:
    """Why TensorFlow's ``map_parallelization`` rewrite will NOT parallelize this sequential map (empty: it will)."""
    reasons = []
    opt = opts.optimization_options
    enabled = (opt.map_parallelization if opt.WhichOneof("optional_map_parallelization")
               else (opt.apply_default_optimizations
                     if opt.WhichOneof("optional_apply_default_optimizations") else True))
    if not enabled:
        reasons.append("map_parallelization is turned off in this pipeline's tf.data.Options")
    if opts.autotune_options.WhichOneof("optional_enabled") and not opts.autotune_options.enabled:
        reasons.append("autotune is turned off in this pipeline's tf.data.Options")
    stateful = pipe.stateful_ops(node)
    if stateful:
        reasons.append(f"its function has stateful ops {stateful}")
    if node.attr["force_synchronous"].b:
        reasons.append("it was built with synchronous=True")
    return reasons


# ------------------------------------------------------------------------------------------------------------
# check: facts gathered once, then each lint rule (a small function of the facts) in the table _LINT_RULES.


@dataclasses.dataclass(frozen=True)
class _LintFacts:
    """What the lint rules read: the pipeline's graph, its effective ``tf.data.Options`` and check()'s settings."""

    pipe: _Pipeline
    options: dataset_options_pb2.Options
    num_replicas: int
    jit_compile: bool
    cache_max_bytes: int
    expensive_op_count: int
    min_shuffle_fraction: float

    def nodes(self, ops: Optional[Set[str]] = None) -> List[Any]:
        """The pipeline's dataset nodes in graph order, those whose op is in ``ops`` when given."""
        return [n for n in self.pipe.dataset_nodes() if ops is None or n.op in ops]

    def input_count(self, node: Any) -> Optional[int]:
        """Elements flowing into ``node`` (cardinality of its first dataset input); ``None`` if unknown."""
        upstream = self.pipe.dataset_inputs(node)
        return self.pipe.cardinality(upstream[0]) if upstream else None


def _gather_lint_facts(dataset: tf.data.Dataset, num_replicas: Optional[int], jit_compile: bool,
                       cache_max_bytes: int, expensive_op_count: int, min_shuffle_fraction: float) -> _LintFacts:
    """Validate check()'s settings and read the dataset's graph once."""
    _require_dataset(dataset, "check")
    if num_replicas is None:
        num_replicas = _default_num_replicas()
    check_int("num_replicas", num_replicas)
    if not 0 < min_shuffle_fraction <= 1:
        raise ValueError(f"min_shuffle_fraction must be in (0, 1], got {min_shuffle_fraction!r}")
    if cache_max_bytes < 0:
        raise ValueError(f"cache_max_bytes must be >= 0 bytes, got {cache_max_bytes!r}")
    pipe = _Pipeline(pipeline_graph(dataset))
    return _LintFacts(pipe, pipe.options(), num_replicas, jit_compile, cache_max_bytes, expensive_op_count,
                      min_shuffle_fraction)


def _lint_no_prefetch(f: _LintFacts) -> List[Finding]:
    """``no_prefetch``: the last transformation (behind ``with_options``) is not ``prefetch``."""
    last = f.pipe.last_transformation()
    if last.op in _PREFETCH:
        return []
    opt, autotune_opts = f.options.optimization_options, f.options.autotune_options
    injected = (opt.inject_prefetch if opt.WhichOneof("optional_inject_prefetch") else
                (opt.apply_default_optimizations if opt.WhichOneof("optional_apply_default_optimizations")
                 else True))
    autotune = autotune_opts.enabled if autotune_opts.WhichOneof("optional_enabled") else True
    note = (" TensorFlow's inject_prefetch rewrite may add one when the last step is synchronous, but only "
            "with default options and autotune on." if injected and autotune else
            " inject_prefetch/autotune is off in this pipeline's options, so TensorFlow will not add one.")
    return [Finding(
        "no_prefetch", "warning",
        f"the pipeline ends with {last.op} '{last.name}', not prefetch: the next batch is only prepared "
        "after the training step asks for it." + note,
        "End the pipeline with .prefetch(tf.data.AUTOTUNE).",
        last.name)]


def _optimize_hint(pipe: _Pipeline, node: Any) -> str:
    """The tail of a ``sequential_map`` fix naming what :func:`optimize` can do for this map ("" if nothing)."""
    if node.op not in _SEQUENTIAL_MAP or node.attr["force_synchronous"].b:
        return ""
    stateful = pipe.stateful_ops(node)
    if not stateful:
        return ", or keras_scale.data.optimize(ds)"
    if all(_is_random_op(s) for s in stateful):
        if pipe.seeded_random_ops(node):  # optimize() keeps seeded draws sequential unless told otherwise
            return ", or keras_scale.data.optimize(ds, parallelize_random=True) (draws then not reproducible)"
        return ", or keras_scale.data.optimize(ds)"
    return ""


def _lint_sequential_map(f: _LintFacts) -> List[Finding]:
    """``sequential_map``: a map without ``num_parallel_calls`` (or with 1); info when TF parallelizes it itself."""
    findings = []
    for node in f.nodes(_SEQUENTIAL_MAP | _PARALLEL_MAP):
        if node.op in _SEQUENTIAL_MAP:
            what, blockers = "map without num_parallel_calls", _auto_parallel_blockers(f.pipe, node, f.options)
        elif f.pipe.const(node, "num_parallel_calls") == 1:
            what, blockers = "map with num_parallel_calls=1", ["it asks for 1"]
        else:
            continue
        if blockers:
            findings.append(Finding(
                "sequential_map", "warning",
                f"'{node.name}' is a {what}: it runs one element at a time, and TensorFlow will not "
                f"parallelize it because {'; '.join(blockers)}.",
                "Use .map(fn, num_parallel_calls=tf.data.AUTOTUNE) (order is kept: deterministic=True is the "
                f"default){_optimize_hint(f.pipe, node)}.",
                node.name))
        else:
            findings.append(Finding(
                "sequential_map", "info",
                f"'{node.name}' is a {what}; TensorFlow's default map_parallelization rewrite will "
                "parallelize it at runtime (stateless function), but that silently stops once the function "
                "gains a stateful op (e.g. tf.random.uniform) or someone turns the option off.",
                "Say it explicitly: .map(fn, num_parallel_calls=tf.data.AUTOTUNE).",
                node.name))
    return findings


def _lint_py_function(f: _LintFacts) -> List[Finding]:
    """``py_function``: Python (py_function, numpy_function, from_generator) inside a dataset's functions."""
    findings = []
    for node in f.nodes():
        py_ops = sorted(f.pipe.ops_of(node) & _PY_FUNC)
        if not py_ops:
            continue
        kind = (f"{node.op} (the op tf.data.Dataset.from_generator reads a Python generator with)"
                if node.op == "FlatMapDataset" else node.op)
        findings.append(Finding(
            "py_function", "warning",
            f"{kind} '{node.name}' runs Python ({', '.join(py_ops)}) in function {_map_fn_name(f.pipe, node)}: "
            "it holds the GIL, so num_parallel_calls cannot scale it and it starves the accelerator.",
            "Rewrite the function with TensorFlow ops (tf.strings, tf.image, tf.io, tf.numpy); if Python is "
            "unavoidable, batch() first and call it once per batch, or precompute the result offline.",
            node.name))
    return findings


def _lint_batch_remainder(f: _LintFacts) -> List[Finding]:
    """``batch_remainder``: a batch keeps a short last batch while replicas split batches or XLA compiles."""
    why = []
    if f.num_replicas > 1:
        why.append(f"{f.num_replicas} replicas split each batch (a short last batch gives them unequal or empty "
                   "shards)")
    if f.jit_compile:
        why.append("XLA compiles one program per shape (the short last batch triggers a recompile)")
    if not why:
        return []  # one replica without XLA: a short last batch is harmless
    findings = []
    for node in f.nodes(_BATCH):
        drop = f.pipe.const(node, "drop_remainder")
        if drop is None or bool(drop):
            continue
        batch_size = f.pipe.const(node, "batch_size")
        n_in = f.input_count(node)
        known = isinstance(n_in, int) and isinstance(batch_size, int) and batch_size > 0
        if known and n_in % batch_size == 0:
            continue
        rest = f" ({n_in} elements, {n_in % batch_size} left over)" if known else ""
        findings.append(Finding(
            "batch_remainder", "warning",
            f"'{node.name}' batches by {batch_size} without drop_remainder{rest}; " + "; ".join(why) + ".",
            f".batch({batch_size}, drop_remainder=True) (or make the dataset size a multiple of the global batch).",
            node.name))
    return findings


def _lint_cache_missing(f: _LintFacts) -> List[Finding]:
    """``cache_missing``: an expensive, deterministic map with a small output and no ``cache()`` after it."""
    findings = []
    for node in f.nodes(_SEQUENTIAL_MAP | _PARALLEL_MAP):
        heavy = sorted(f.pipe.ops_of(node) & _EXPENSIVE_OPS)
        count = sum(f.pipe.function_node_count(fn) for fn in f.pipe.node_functions(node))
        if (not heavy and count < f.expensive_op_count) or f.pipe.stateful_ops(node):
            continue  # cheap; or random augmentation / variables: caching would freeze or stale the result
        if any(n.op in _CACHE for n in f.pipe.downstream(node.name)):
            continue
        n, per_element = f.pipe.cardinality(node.name), f.pipe.element_bytes(node)
        if not isinstance(n, int) or per_element is None or n * per_element > f.cache_max_bytes:
            continue
        why = f"ops {heavy}" if heavy else f"{count} ops"
        findings.append(Finding(
            "cache_missing", "warning",
            f"map '{node.name}' is expensive ({why}) and deterministic, and its output is small ({n} elements, "
            f"{n * per_element / 2**20:.3g} MiB <= {f.cache_max_bytes / 2**20:.4g} MiB), yet nothing caches it: "
            "it is recomputed every epoch.",
            "Add .cache() right after this map (before shuffle and random augmentation), or .cache(path) on disk.",
            node.name))
    return findings


def _lint_large_memory_cache(f: _LintFacts) -> List[Finding]:
    """``large_memory_cache``: ``cache()`` in host memory over more than the budget, or over an infinite input."""
    findings = []
    for node in f.nodes(_CACHE):
        if f.pipe.const(node, "filename") != b"":
            continue  # cached on disk
        n_in, per_element = f.input_count(node), f.pipe.element_bytes(node)
        total = n_in * per_element if isinstance(n_in, int) and per_element is not None else None
        if n_in != math.inf and (total is None or total <= f.cache_max_bytes):
            continue
        size = ("an infinite input (repeat() before cache())" if n_in == math.inf
                else f"{n_in} elements, {total / 2**20:.4g} MiB > {f.cache_max_bytes / 2**20:.4g} MiB")
        findings.append(Finding(
            "large_memory_cache", "warning",
            f"'{node.name}' caches in host memory {size}: "
            + ("host memory grows without bound." if n_in == math.inf else
               "host memory grows through the first epoch until it holds all of it (or runs out)."),
            "Cache to disk with .cache('/fast/local/path/cache') or cache a smaller, earlier stage "
            "(before decoding); put repeat() after cache().",
            node.name))
    return findings


def _lint_small_shuffle_buffer(f: _LintFacts) -> List[Finding]:
    """``small_shuffle_buffer``: a shuffle buffer below ``min_shuffle_fraction`` of the elements (and < 10 000)."""
    findings = []
    for node in f.nodes(_SHUFFLE):
        buffer_size, n_in = f.pipe.const(node, "buffer_size"), f.input_count(node)
        if not (isinstance(buffer_size, int) and isinstance(n_in, int) and n_in > 1 and buffer_size < n_in
                and buffer_size < f.min_shuffle_fraction * n_in and buffer_size < 10_000):
            continue
        findings.append(Finding(
            "small_shuffle_buffer", "warning",
            f"'{node.name}' shuffles {n_in} elements through a buffer of {buffer_size} "
            f"({100.0 * buffer_size / n_in:.2g}% of the data): an element can only move ~{buffer_size} "
            "places, so batches keep the source order.",
            f".shuffle({min(n_in, 10_000)}) (buffer >= {f.min_shuffle_fraction:.0%} of the data), or shuffle "
            "the file list and interleave files before a smaller record-level shuffle.",
            node.name))
    return findings


# The lint, one rule per Finding code, in the order check() reports them. A new rule: a function of
# _LintFacts returning its findings, added here, to Finding's docstring and to docs/data.md's table.
_LINT_RULES: Tuple[Callable[[_LintFacts], List[Finding]], ...] = (
    _lint_no_prefetch, _lint_sequential_map, _lint_py_function, _lint_batch_remainder, _lint_cache_missing,
    _lint_large_memory_cache, _lint_small_shuffle_buffer,
)


def check(
    dataset: tf.data.Dataset,
    *,
    num_replicas: Optional[int] = None,
    jit_compile: bool = False,
    cache_max_bytes: int = 1 << 30,
    expensive_op_count: int = 16,
    min_shuffle_fraction: float = 0.01,
    warn: bool = True,
) -> List[Finding]:
    """Lint a ``tf.data`` pipeline from its serialized graph; returns findings and warns about each warning.

    Checks (findings come in this order, then in pipeline order):
      - ``no_prefetch``: the last transformation is not ``prefetch`` (input and training do not overlap).
      - ``sequential_map``: ``map`` without ``num_parallel_calls`` (or with 1). ``severity="info"`` when
        TensorFlow's default ``map_parallelization`` rewrite will parallelize it at runtime (stateless function,
        autotune and the option not turned off); ``"warning"`` when it will not (e.g. ``tf.random.uniform`` in it).
      - ``py_function``: ``tf.py_function``/``tf.numpy_function`` inside a map/filter/interleave function
        (holds the Python GIL: does not scale with ``num_parallel_calls``).
      - ``batch_remainder``: ``batch`` without ``drop_remainder=True`` while a multi-replica strategy or XLA is
        active and the data does not divide evenly (the short last batch recompiles the XLA program / gives
        replicas unequal or empty shards).
      - ``cache_missing``: an expensive, deterministic map whose output fits in ``cache_max_bytes`` is recomputed
        every epoch (no ``cache()`` after it).
      - ``large_memory_cache``: ``cache()`` without a filename over more than ``cache_max_bytes`` of data (or
        an infinite input): host memory grows through the first epoch until it holds all of it.
      - ``small_shuffle_buffer``: ``shuffle`` buffer smaller than ``min_shuffle_fraction`` of the elements it
        shuffles (and < 10 000): batches stay nearly in file order.

    Args:
        dataset: the ``tf.data.Dataset`` given to ``model.fit``.
        num_replicas: replicas training in sync; default: ``tf.distribute.get_strategy().num_replicas_in_sync``.
        jit_compile: whether the model is compiled with XLA (``model.compile(jit_compile=True)``).
        cache_max_bytes: data up to this size counts as "small" (cacheable in RAM); an in-memory cache over more
            is flagged.
        expensive_op_count: a map function with at least this many non-trivial ops counts as expensive (decode,
            parse, resize, file-read and Python ops count as expensive on their own).
        min_shuffle_fraction: shuffle buffers below this fraction of the shuffled elements are flagged.
        warn: emit a :class:`PipelineWarning` for each ``warning`` finding.

    Example:
        >>> ds = tf.data.Dataset.range(10_000).shuffle(8).batch(64)
        >>> for f in check(ds, warn=False):
        ...     print(f.code)
        no_prefetch
        small_shuffle_buffer
    """
    facts = _gather_lint_facts(dataset, num_replicas, jit_compile, cache_max_bytes, expensive_op_count,
                               min_shuffle_fraction)
    findings = [finding for rule in _LINT_RULES for finding in rule(facts)]
    if warn:
        for f in findings:
            if f.severity != "info":
                warnings.warn(f"keras_scale.data.check: {f}", PipelineWarning, stacklevel=2)
    return findings


# ------------------------------------------------------------------------------------------------------------
# benchmark


@dataclasses.dataclass(frozen=True)
class BenchmarkResult:
    """Throughput of an input pipeline measured alone (no model), by :func:`benchmark`.

    Attributes:
        num_steps: batches timed (after warm-up); fewer than asked if the dataset ran out.
        num_samples: samples in those batches (leading dimension of the first component of each element).
        elapsed_s: wall time of the timed batches, seconds.
        batches_per_s, samples_per_s: the rates; compare ``batches_per_s`` with the training step rate — if the
            pipeline alone is not clearly faster than the steps, the accelerator waits for input.
        warmup_steps: batches consumed before timing started (thread pools, autotune, file opening).

    Example:
        >>> r = benchmark(tf.data.Dataset.range(1000).batch(10), num_steps=50)
        >>> r.num_samples
        500
    """

    num_steps: int
    num_samples: int
    elapsed_s: float
    batches_per_s: float
    samples_per_s: float
    warmup_steps: int

    def __str__(self) -> str:
        return (f"{self.batches_per_s:.1f} batches/s, {self.samples_per_s:.1f} samples/s "
                f"({self.num_steps} batches in {self.elapsed_s:.3f} s after {self.warmup_steps} warm-up)")


def _batch_size_of(element: Any) -> int:
    for t in tf.nest.flatten(element):
        shape = getattr(t, "shape", None)
        if shape is not None and shape.rank:
            return int(shape[0])
        if shape is not None:
            return 1
    return 1


def benchmark(dataset: tf.data.Dataset, num_steps: int = 100, warmup_steps: int = 10) -> BenchmarkResult:
    """Iterate ``dataset`` alone and time ``num_steps`` batches after ``warmup_steps`` untimed ones.

    Each element is fetched to the host as a tensor (the same work ``model.fit`` asks of the pipeline); nothing
    else runs, so the result is the pipeline's ceiling. Use a dataset that yields at least
    ``warmup_steps + num_steps`` batches (``.repeat()`` is fine).

    Example:
        >>> ds = tf.data.Dataset.range(10_000).batch(100).prefetch(tf.data.AUTOTUNE)
        >>> result = benchmark(ds, num_steps=50, warmup_steps=5)
        >>> result.samples_per_s > result.batches_per_s
        True
    """
    _require_dataset(dataset, "benchmark")
    check_int("num_steps", num_steps, hint="It is how many batches to time.")
    check_int("warmup_steps", warmup_steps, 0)
    iterator = iter(dataset)
    warmed = 0
    for _ in range(warmup_steps):
        try:
            next(iterator)
        except StopIteration:
            break
        warmed += 1
    steps = samples = 0
    start = time.perf_counter()
    for _ in range(num_steps):
        try:
            element = next(iterator)
        except StopIteration:
            break
        steps += 1
        samples += _batch_size_of(element)
    elapsed_s = time.perf_counter() - start
    if steps == 0:
        raise ValueError(
            f"the dataset ran out during the {warmed} warm-up batches: nothing left to time. Use fewer "
            f"warmup_steps (got {warmup_steps}) or a longer dataset (e.g. dataset.repeat()).")
    elapsed_s = max(elapsed_s, 1e-9)
    return BenchmarkResult(num_steps=steps, num_samples=samples, elapsed_s=elapsed_s,
                           batches_per_s=steps / elapsed_s, samples_per_s=samples / elapsed_s,
                           warmup_steps=warmed)


# ------------------------------------------------------------------------------------------------------------
# optimize

# Top-level ops whose state lives outside the graph (variables, tables, Python callbacks): rebuilding the
# pipeline from its graph would copy or lose that state, so such graphs are not rebuilt.
_STATE_OPS = {"VarHandleOp", "AssignVariableOp", "HashTableV2", "MutableHashTableV2", "AnonymousSeedGenerator",
              "DummySeedGenerator", "AnonymousRandomSeedGenerator"}


def _rebuild_blockers(pipe: _Pipeline) -> Tuple[List[str], List[str]]:
    """``(blockers, notes)``: why the graph cannot be rebuilt without losing state, and what a rebuild changes."""
    reasons, notes = [], []
    for node in pipe.graph_def.node:
        if node.op == "Const" and node.attr["dtype"].type == tf.resource.as_datatype_enum:
            users = pipe.consumers_of(node.name)
            if users and all(pipe.nodes[u].op in _SHUFFLE for u in users):
                notes.extend(f"shuffle '{u}' draws a different permutation than the original pipeline would "
                             "(same seed settings; reshuffled each epoch as configured)" for u in users)
            else:
                reasons.append(f"'{node.name}' is a resource used by {users}")
        elif node.op in _STATE_OPS or (node.op not in ("Const", "_Retval", "Identity") and not _is_dataset_op(node.op)):
            reasons.append(f"'{node.name}' ({node.op}) holds state outside the graph")
    for node in pipe.dataset_nodes():
        if pipe.ops_of(node) & _PY_FUNC:
            reasons.append(f"'{node.name}' calls Python")
    return reasons, notes


def optimize(dataset: tf.data.Dataset, *,
             parallelize_random: Optional[bool] = None) -> Tuple[tf.data.Dataset, List[str]]:
    """Apply the safe speed fixes to a pipeline; returns ``(dataset, changes)``.

    1. ``tf.data.Options``: ``map_parallelization=True`` (TensorFlow's own rewrite of sequential maps with
       stateless functions into parallel, order-keeping ones), ``autotune.enabled=True``, and
       ``deterministic=True`` unless you set it. These are TensorFlow's defaults; setting them re-enables them
       where a pipeline turned them off and pins them.
    2. A trailing ``prefetch(tf.data.AUTOTUNE)`` if the pipeline does not end with one.
    3. Sequential maps whose only stateful ops are random-number ops (``tf.random.uniform``,
       ``tf.image.random_*``, ... which TensorFlow's rewrite refuses) are rewritten in the graph into
       ``ParallelMapDatasetV2(num_parallel_calls=AUTOTUNE, deterministic=true)`` and the pipeline is rebuilt from
       the graph. Element order is kept, but which random draw goes to which element then depends on thread
       timing, and a rebuilt seeded ``shuffle`` draws a different (still seeded, reproducible) permutation.
       ``parallelize_random=None`` (default) does this unless you asked for determinism: a seed on the map's
       random ops (``seed=`` or ``tf.random.set_seed``), ``deterministic=True`` in your ``tf.data.Options``,
       or ``tf.config.experimental.enable_op_determinism()``; such maps stay sequential, with a
       ``"not changed"`` entry. ``True`` parallelizes them anyway, ``False`` never. Graphs holding outside
       state (variables, lookup tables, Python functions) are never rebuilt, since the copy would not share
       that state.

    Entries of ``changes`` starting with ``"not changed:"`` explain what was left alone and what to write
    instead.

    Example:
        >>> ds = tf.data.Dataset.range(64).map(lambda x: x + tf.random.uniform((), 0, 2, tf.int64)).batch(8)
        >>> fast, changes = optimize(ds)  # the random map is unseeded: parallelized
        >>> for c in changes:
        ...     print(c)  # doctest: +SKIP
        parallelized map 'MapDataset/_4' (num_parallel_calls=AUTOTUNE, deterministic order; random ops ['RandomUniformInt'])
        tf.data.Options: map_parallelization=True, autotune.enabled=True, deterministic=True
        appended prefetch(tf.data.AUTOTUNE) after BatchDatasetV2 'BatchDatasetV2/_7'
    """
    _require_dataset(dataset, "optimize")
    if parallelize_random not in (None, True, False):
        raise TypeError(f"keras_scale.data.optimize: parallelize_random must be None (default: parallelize random "
                        f"maps unless you asked for determinism), True or False; got {parallelize_random!r}")
    parallelize_random = None if parallelize_random is None else bool(parallelize_random)
    pipe = _Pipeline(pipeline_graph(dataset))
    opts = pipe.options()
    # Step 3 first, since it rebuilds the dataset; each step returns (dataset, changes, not changed).
    dataset, maps_done, maps_left = _parallelize_random_maps(dataset, pipe, opts, parallelize_random)
    dataset, options_done, options_left = _pin_default_options(dataset, opts)
    dataset, prefetch_done = _append_prefetch(dataset, pipe)
    return dataset, maps_done + options_done + prefetch_done + maps_left + options_left


def _maps_to_parallelize(pipe: _Pipeline,
                         parallelize_random: Optional[bool]) -> Tuple[List[Tuple[Any, List[str]]], List[str]]:
    """``(targets, not_changed)``: the sequential maps TF's own rewrite skips that optimize() may rewrite (each
    with its stateful ops), and why the others stay as they are. Stateless maps are in neither: TF's
    ``map_parallelization`` (pinned on by :func:`_pin_default_options`) parallelizes them at runtime."""
    targets, not_changed = [], []
    opts = pipe.options()
    asked_globally = []
    if opts.WhichOneof("optional_deterministic") is not None and opts.deterministic:
        asked_globally.append("deterministic=True in your tf.data.Options")
    if tf_config.is_op_determinism_enabled():
        asked_globally.append("tf.config.experimental.enable_op_determinism()")

    def determinism_asked(node: Any) -> str:
        seeded = pipe.seeded_random_ops(node)
        return "; ".join(asked_globally + ([f"seeded random ops {seeded}"] if seeded else []))

    for node in pipe.dataset_nodes():
        if node.op not in _SEQUENTIAL_MAP:
            continue
        py_ops = sorted(pipe.ops_of(node) & _PY_FUNC)
        stateful = pipe.stateful_ops(node)
        if py_ops:
            not_changed.append(f"not changed: map '{node.name}' calls Python ({py_ops}); parallel calls would "
                               "serialize on the GIL. Rewrite it with TensorFlow ops")
        elif node.attr["force_synchronous"].b:
            not_changed.append(f"not changed: map '{node.name}' was built with synchronous=True")
        elif not stateful:
            continue
        elif not all(_is_random_op(op) or op == "ReadVariableOp" for op in stateful):
            not_changed.append(f"not changed: map '{node.name}' has stateful ops {stateful} whose result depends "
                               "on call order. Parallelize it yourself if that is fine: "
                               ".map(fn, num_parallel_calls=tf.data.AUTOTUNE)")
        elif "ReadVariableOp" in stateful:  # reads are order-free, but a rebuilt copy would not share the variable
            targets.append((node, stateful))
        elif parallelize_random is False:
            not_changed.append(f"not changed: map '{node.name}' stays sequential: its random ops {stateful} stop "
                               "TensorFlow's map_parallelization and you passed parallelize_random=False. "
                               "optimize(ds) parallelizes it (order kept; draws no longer bit-reproducible), or "
                               "use tf.random.stateless_* ops")
        elif parallelize_random is None and determinism_asked(node):
            not_changed.append(f"not changed: map '{node.name}' stays sequential to keep its random draws "
                               f"reproducible, as you asked ({determinism_asked(node)}). "
                               "optimize(ds, parallelize_random=True) parallelizes it anyway (order kept; draws "
                               "no longer bit-reproducible); tf.random.stateless_* ops with a per-element seed "
                               "are reproducible and parallel")
        else:
            targets.append((node, stateful))
    return targets, not_changed


def _parallelize_random_maps(dataset: tf.data.Dataset, pipe: _Pipeline, opts: dataset_options_pb2.Options,
                             parallelize_random: Optional[bool]) -> Tuple[tf.data.Dataset, List[str], List[str]]:
    """Step 3: rewrite the chosen sequential maps into parallel ones and rebuild the pipeline from its graph,
    unless the graph holds outside state (then each target gets a "not changed" entry)."""
    targets, not_changed = _maps_to_parallelize(pipe, parallelize_random)
    if not targets:
        return dataset, [], not_changed
    blockers, notes = _rebuild_blockers(pipe)
    if blockers:
        not_changed.extend(
            f"not changed: map '{node.name}' stays sequential: the pipeline cannot be rebuilt from its graph "
            f"without losing state ({'; '.join(blockers[:3])}). Write .map(fn, num_parallel_calls=tf.data.AUTOTUNE) "
            "in your code" for node, _ in targets)
        return dataset, [], not_changed
    rebuilt = _rebuild_with_parallel_maps(pipe, [node for node, _ in targets], dataset.element_spec)
    if rebuilt is None:
        not_changed.extend(f"not changed: map '{node.name}': rebuilding the pipeline from its graph failed"
                           for node, _ in targets)
        return dataset, [], not_changed
    order = ("deterministic order" if not opts.WhichOneof("optional_deterministic") or opts.deterministic
             else "order not kept: your options say deterministic=False")
    done = [f"parallelized map '{node.name}' (num_parallel_calls=AUTOTUNE, {order}; random ops {ops})"
            for node, ops in targets]
    return rebuilt, done + notes, not_changed


def _pin_default_options(dataset: tf.data.Dataset,
                         opts: dataset_options_pb2.Options) -> Tuple[tf.data.Dataset, List[str], List[str]]:
    """Step 1: set map_parallelization, autotune and deterministic where the pipeline's options leave them unset
    (or turned map_parallelization off); settings the user chose against them are reported, not overridden."""
    options = tf.data.Options()
    set_parts, not_changed = [], []
    opt = opts.optimization_options
    if not (opt.WhichOneof("optional_map_parallelization") and opt.map_parallelization):
        options.experimental_optimization.map_parallelization = True
        set_parts.append("map_parallelization=True")
    if opts.autotune_options.WhichOneof("optional_enabled") and not opts.autotune_options.enabled:
        not_changed.append("not changed: autotune is off in your tf.data.Options; AUTOTUNE values fall back to "
                           "defaults")
    elif not opts.autotune_options.WhichOneof("optional_enabled"):
        options.autotune.enabled = True
        set_parts.append("autotune.enabled=True")
    if opts.WhichOneof("optional_deterministic") is None:
        options.deterministic = True
        set_parts.append("deterministic=True")
    elif not opts.deterministic:
        not_changed.append("not changed: deterministic=False in your tf.data.Options (element order may vary)")
    if not set_parts:
        return dataset, [], not_changed
    return dataset.with_options(options), ["tf.data.Options: " + ", ".join(set_parts)], not_changed


def _append_prefetch(dataset: tf.data.Dataset, pipe: _Pipeline) -> Tuple[tf.data.Dataset, List[str]]:
    """Step 2: a trailing ``prefetch(tf.data.AUTOTUNE)`` unless the pipeline already ends with one."""
    last = pipe.last_transformation()
    if last.op in _PREFETCH:
        return dataset, []
    return (dataset.prefetch(tf.data.AUTOTUNE),
            [f"appended prefetch(tf.data.AUTOTUNE) after {last.op} '{last.name}'"])


def _rebuild_with_parallel_maps(pipe: _Pipeline, targets: Sequence[Any], element_spec: Any) -> Optional[tf.data.Dataset]:
    graph_def = tf.compat.v1.GraphDef()
    graph_def.CopyFrom(pipe.graph_def)
    wanted = {n.name for n in targets}
    for node in list(graph_def.node):
        if node.name not in wanted:
            continue
        const = graph_def.node.add()
        const.name = node.name + "/keras_scale_num_parallel_calls"
        const.op = "Const"
        const.attr["dtype"].type = tf.int64.as_datatype_enum
        const.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(AUTOTUNE, tf.int64))
        control = [i for i in node.input if i.startswith("^")]
        data = [i for i in node.input if not i.startswith("^")]
        del node.input[:]
        node.input.extend(data + [const.name] + control)
        node.op = "ParallelMapDatasetV2"
        if "force_synchronous" in node.attr:
            del node.attr["force_synchronous"]
        node.attr["deterministic"].s = b"default"  # follows Options.deterministic, which optimize() pins to True
        node.attr["use_unbounded_threadpool"].b = False
    try:
        variant = tf.raw_ops.DatasetFromGraph(graph_def=graph_def.SerializeToString())
        rebuilt = tf.data.experimental.from_variant(variant, element_spec)
        original_n = pipe.cardinality(pipe.sink)
        new_n = int(rebuilt.cardinality())
        if original_n is not None and original_n != math.inf and new_n != original_n:
            return None
        return rebuilt
    except Exception:  # noqa: BLE001 - keep the original pipeline
        return None
