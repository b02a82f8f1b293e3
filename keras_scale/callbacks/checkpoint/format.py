"""ChiefCheckpoint's files: TensorFlow's own tensor-bundle format, written new for every checkpoint.

A synchronous save writes ``<prefix>.index`` (an SSTable of ``BundleEntryProto``, TensorFlow's format) and
``<prefix>.data-00000-of-00001`` (the raw tensor bytes, each CRC32C-checksummed) with ``tf.raw_ops.SaveV2``
directly: one op, no temporary folder and merge (``tf.train.Checkpoint.write`` writes ``<prefix>_temp/`` and
merges it), and the object graph (``_CHECKPOINTABLE_OBJECT_GRAPH``) serialized once per run, not per save. So every
TensorFlow tool reads the files: ``tf.train.latest_checkpoint``, ``tf.train.load_checkpoint``,
``tf.train.list_variables`` and ``tf.train.Checkpoint(...).read``. Asynchronous saves are TensorFlow's own
``tf.train.Checkpoint`` writes, in the same format.

Files are never rewritten in place: TensorFlow writes each file under a random temporary name and renames it into
place (data first, index last), and a checkpoint counts only once the ``checkpoint`` state file names it (written
by :class:`CheckpointManager` after the write completed). A retired checkpoint's files are deleted, never reused:
a reader that opened them (an evaluator, a copy to object storage) keeps its bytes (POSIX keeps a deleted file's
data while it is open), and every tensor read is checked against its CRC32C by TensorFlow's reader.

Durability: nothing is fsynced (the same as TensorFlow's and Keras's savers). A checkpoint survives the death of
the process but not necessarily a power loss shortly after a save; a checkpoint torn that way fails its CRC check
on restore and the previous one is used.

Restore (:func:`read_into`) checks the dtype and shape of every entry against its variable and reads (CRC-checks)
every tensor before assigning any, so a damaged or foreign checkpoint never half-overwrites the model.

Example:
    reader = read_checkpoint("ckpt/ckpt-300")
    reader.get_tensor("keras_scale_position/global_step/.ATTRIBUTES/VARIABLE_VALUE")
    # 300
"""
from __future__ import annotations

import base64
import json
import os
import re
import zlib
from typing import Any, Dict, Iterable, List, Optional

import numpy as np
import tensorflow as tf

from keras_scale.storage import is_local

__all__ = ["CorruptCheckpointError", "BundleCheckpoint", "CheckpointManager", "flatten", "is_raw", "read_checkpoint",
           "load_checkpoint", "read_into", "write_checkpoint", "DATA_SUFFIX", "OBJECT_GRAPH_KEY"]

DATA_SUFFIX = ".data-00000-of-00001"
RETIRING_NAME = "checkpoint.retiring"  # the checkpoints a rotation is deleting (removed once they are gone)
OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
LEGACY_FORMAT = "keras_scale.raw/1"  # synchronous saves of earlier versions (read only)
_ATTR = ".ATTRIBUTES/VARIABLE_VALUE"


class CorruptCheckpointError(OSError):
    """A checkpoint file is truncated, torn or damaged (size, JSON or CRC check failed)."""


# ------------------------------------------------------------------------------------------------ names
def flatten(items: Dict[str, Any]) -> Dict[str, Any]:
    """``{checkpoint key: variable}`` for ``tf.train.Checkpoint(**items)``-style items (a variable, a list or a
    dict of variables per name), with the keys TensorFlow's object-based checkpoint uses.

    Example:
        flatten({"w": [v0, v1], "pos": {"epoch": e}})
        # {'w/0/.ATTRIBUTES/VARIABLE_VALUE': v0, 'w/1/...': v1, 'pos/epoch/.ATTRIBUTES/VARIABLE_VALUE': e}
    """
    out: Dict[str, Any] = {}
    for name, item in items.items():
        if isinstance(item, dict):
            for k, v in item.items():
                out[f"{name}/{k}/{_ATTR}"] = v
        elif isinstance(item, (list, tuple)):
            for i, v in enumerate(item):
                out[f"{name}/{i}/{_ATTR}"] = v
        else:
            out[f"{name}/{_ATTR}"] = item
    return out


def remove_entry(path: str) -> None:
    """Delete a file or link at ``path`` (never what a link points to); a missing one is fine."""
    try:
        if is_local(path):
            os.unlink(path)
        else:
            tf.io.gfile.remove(path)
    except (FileNotFoundError, tf.errors.NotFoundError):
        pass
    except IsADirectoryError:
        pass


def clear_prefix(prefix: str) -> None:
    """Remove whatever sits at checkpoint ``prefix``'s file names before it is written (a torn earlier write, a
    planted link): TensorFlow opens some of them by name, and a link must never lead a write out of the directory."""
    directory, base = os.path.split(prefix)
    try:
        names = os.listdir(directory or ".") if is_local(prefix) else tf.io.gfile.listdir(directory)
    except (OSError, tf.errors.OpError):
        return
    for name in names:
        name = name.rstrip("/")
        if name == base + ".index" or name.startswith(base + ".data-") or name.startswith(base + ".index."):
            remove_entry(os.path.join(directory, name))
        elif name == base + "_temp":  # tf.train.Checkpoint.write's temporary folder
            path = os.path.join(directory, name)
            if is_local(path) and (os.path.islink(path) or not os.path.isdir(path)):
                remove_entry(path)
            else:
                tf.io.gfile.rmtree(path)


# ------------------------------------------------------------------------------------------------ writing
def object_graph(tf_checkpoint: tf.train.Checkpoint) -> bytes:
    """The serialized ``TrackableObjectGraph`` of ``tf_checkpoint`` (what ``tf.train.Checkpoint.read`` matches
    objects by), as TensorFlow's own writer stores it under ``_CHECKPOINTABLE_OBJECT_GRAPH``."""
    from tensorflow.python.checkpoint import graph_view, save_util

    _, _, _, proto = save_util.serialize_graph_view(graph_view.ObjectGraphView(tf_checkpoint))
    return proto.SerializeToString()


def _value(variable: Any) -> Any:
    return variable.read_value() if hasattr(variable, "read_value") else tf.convert_to_tensor(variable)


def write_checkpoint(prefix: str, variables: Dict[str, Any], graph: Optional[bytes] = None) -> str:
    """Write ``variables`` (``{key: variable}``) as TensorFlow tensor bundle ``prefix`` (``<prefix>.index`` +
    ``<prefix>.data-00000-of-00001``), plus the object graph ``graph`` if given; returns ``prefix``.

    Example:
        write_checkpoint("/tmp/ck/ckpt-1", flatten({"w": model.variables}))
        tf.train.load_checkpoint("/tmp/ck/ckpt-1").get_tensor("w/0/.ATTRIBUTES/VARIABLE_VALUE")
    """
    clear_prefix(prefix)
    names = list(variables)
    tensors = [_value(variables[k]) for k in names]
    if graph is not None:
        names.append(OBJECT_GRAPH_KEY)
        tensors.append(tf.constant(graph, dtype=tf.string))
    with tf.device("/cpu:0"):
        tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names), tensors=tensors)
    return prefix


class BundleCheckpoint:
    """Stands in for a ``tf.train.Checkpoint`` inside :class:`CheckpointManager` so that the manager's
    numbering, state file and rotation stay TensorFlow's while the files are written by :func:`write_checkpoint`.

    Example:
        manager = CheckpointManager(BundleCheckpoint(tf_ckpt, flatten(items)), "ckpt")
        manager.save(checkpoint_number=100)
    """

    def __init__(self, tf_checkpoint: tf.train.Checkpoint, variables: Dict[str, Any]) -> None:
        self._tf_checkpoint = tf_checkpoint
        self.variables = variables
        self._graph: Optional[bytes] = None
        self._with_counter: Optional[Dict[str, Any]] = None

    @property
    def save_counter(self) -> tf.Variable:
        return self._tf_checkpoint.save_counter

    def _write(self, file_prefix: str, options: Any = None, write_done_callback: Any = None) -> str:
        if self._graph is None:  # once: the set of objects does not change within a run
            counter = self._tf_checkpoint.save_counter  # (created by now: the manager counts saves)
            self._with_counter = dict(self.variables)
            self._with_counter[f"save_counter/{_ATTR}"] = counter
            self._graph = object_graph(self._tf_checkpoint)
        write_checkpoint(file_prefix, self._with_counter, self._graph)
        for callback in list(getattr(options, "experimental_write_callbacks", None) or []):
            callback(file_prefix)
        if write_done_callback is not None:
            write_done_callback(file_prefix)
        return file_prefix

    write = _write

    def sync(self) -> None:
        """Nothing to wait for: :meth:`_write` returns once the checkpoint is complete."""


class CheckpointManager(tf.train.CheckpointManager):
    """``tf.train.CheckpointManager`` that records the state file *before* it deletes retired checkpoints (a kill
    during rotation never leaves the state file naming a deleted checkpoint), first writing their names to
    ``checkpoint.retiring`` (a kill between the state file and the deletion leaves that record, and the next start
    finishes the deletion: :func:`keras_scale.callbacks.checkpoint.directory.orphans`), deletes an index before its data
    (a torn deletion leaves only an orphan data file, removed at the next start), and clears a checkpoint's file
    names before each write (no link is followed out of the directory).

    Example:
        manager = CheckpointManager(tf.train.Checkpoint(w=w), "ckpt", max_to_keep=2, checkpoint_name="ckpt")
    """

    _retired: Optional[List[str]] = None

    def save(self, checkpoint_number: Any = None, check_interval: bool = True, options: Any = None) -> Any:
        if isinstance(checkpoint_number, int) and is_local(self._prefix):
            clear_prefix(f"{self._prefix}-{checkpoint_number}")
        return super().save(checkpoint_number=checkpoint_number, check_interval=check_interval, options=options)

    def _sweep(self) -> None:  # tf.train.CheckpointManager._sweep's loop, deleting only after _record_state
        if not self._max_to_keep:
            return
        while len(self._maybe_delete) > self._max_to_keep:
            filename, timestamp = self._maybe_delete.popitem(last=False)
            if (self._keep_checkpoint_every_n_hours
                    and (timestamp - self._keep_checkpoint_every_n_hours * 3600.
                         >= self._last_preserved_timestamp)):
                self._last_preserved_timestamp = timestamp
                continue
            self._retired = (self._retired or []) + [filename]

    def _record_state(self) -> None:
        retired, self._retired = self._retired or [], None
        journal = os.path.join(self.directory, RETIRING_NAME)
        if retired:  # first say what is about to go: a kill after the state file stops naming them leaves a record
            from keras_scale.storage import write_atomic

            write_atomic(journal, json.dumps([os.path.basename(p) for p in retired]))
        super()._record_state()
        for prefix in retired:
            delete_checkpoint(prefix)
        if retired:
            remove_entry(journal)


def delete_checkpoint(prefix: str) -> None:
    """Delete checkpoint ``prefix``'s files, the index first (what is left of a torn deletion is an orphan data
    file, never an index without its data). The files are found by listing the directory, never by a pattern: a
    ``[`` or ``*`` in the path is a character like any other.

    Example:
        delete_checkpoint("runs/exp[1]/ckpt/ckpt-300")
    """
    remove_entry(prefix + ".index")
    for path in data_files(prefix):
        remove_entry(path)


_DATA_RE = re.compile(r"\.data-(\d{5})-of-(\d{5})$")


def data_files(prefix: str) -> List[str]:
    """The data shards ``<prefix>.data-NNNNN-of-MMMMM`` that exist, sorted; found by listing the directory and
    comparing names (no glob: the path may hold ``[``, ``*`` or ``?``).

    Example:
        data_files("ckpt/ckpt-300")   # ['ckpt/ckpt-300.data-00000-of-00001']
    """
    directory, base = os.path.split(prefix)
    try:
        names = os.listdir(directory or ".") if is_local(prefix) else tf.io.gfile.listdir(directory)
    except (OSError, tf.errors.OpError):
        return []
    head = base + ".data-"
    return sorted(os.path.join(directory, n.rstrip("/")) for n in names
                  if n.startswith(head) and _DATA_RE.fullmatch(n.rstrip("/")[len(base):]))


def is_complete(prefix: str) -> bool:
    """Checkpoint ``prefix`` has its ``.index`` and every data shard its names promise (``-of-MMMMM``): what a
    write that finished leaves (TensorFlow renames the index into place last). Its bytes are not read.

    Example:
        is_complete("ckpt/ckpt-300")   # True
    """
    if not tf.io.gfile.exists(prefix + ".index"):
        return False
    shards = [_DATA_RE.search(p) for p in data_files(prefix)]
    counts = {int(m.group(2)) for m in shards if m}
    if len(counts) != 1:
        return False
    (count,) = counts
    return {int(m.group(1)) for m in shards if m} == set(range(count))


def verify_checkpoint(prefix: str) -> None:
    """Read every tensor of checkpoint ``prefix`` (each checked against its CRC32C) and its position: what a
    resuming ``fit`` checks before it uses a checkpoint, and what ``keras-scale checkpoint ls`` checks. Raises
    :class:`CorruptCheckpointError` (or TensorFlow's error) naming the damage; returns quietly when it loads.

    Example:
        verify_checkpoint("ckpt/ckpt-300")   # raises for a truncated or bit-flipped checkpoint
    """
    reader = read_checkpoint(prefix)
    dtypes = reader.get_variable_to_dtype_map()
    shapes = reader.get_variable_to_shape_map()
    _read_all(reader, prefix, sorted(dtypes), dtypes, shapes)


# ------------------------------------------------------------------------------------------------ reading
def is_raw(prefix: str) -> bool:
    """True when ``prefix`` is a synchronous checkpoint of an earlier keras_scale (a JSON index; TensorFlow's is
    an SSTable).

    Example:
        is_raw("ckpt/ckpt-300")  # False for everything this version writes
    """
    try:
        with tf.io.gfile.GFile(prefix + ".index", "rb") as f:
            return f.read(1) == b"{"
    except (tf.errors.OpError, OSError):
        return False


class LegacyReader:
    """Reads a synchronous checkpoint of an earlier keras_scale (raw bytes + a JSON index) with the interface of
    ``tf.train.load_checkpoint``'s reader; every tensor returned is a copy, checked against its CRC32.

    Example:
        LegacyReader("old/ckpt-300").get_variable_to_shape_map()
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        try:
            with tf.io.gfile.GFile(prefix + ".index", "rb") as f:
                self._index = json.loads(f.read().decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptCheckpointError(f"{prefix}.index is not a readable checkpoint index ({e})") from e
        if not isinstance(self._index, dict) or self._index.get("format") != LEGACY_FORMAT:
            raise CorruptCheckpointError(f"{prefix}.index is not a {LEGACY_FORMAT} index")
        self._tensors: Dict[str, Dict[str, Any]] = self._index["tensors"]
        self._strings: Dict[str, str] = self._index["strings"]
        self._data: Any = None

    def _buffer(self) -> Any:
        if self._data is None:
            path = self.prefix + DATA_SUFFIX
            expected = int(self._index["data_bytes"])
            with tf.io.gfile.GFile(path, "rb") as f:
                data = f.read()
            if len(data) != expected:
                raise CorruptCheckpointError(f"{path} holds {len(data)} bytes, its index says {expected}: the file "
                                             "is truncated or torn")
            self._data = data
        return self._data

    def has_tensor(self, key: str) -> bool:
        return key in self._tensors or key in self._strings

    def get_variable_to_shape_map(self) -> Dict[str, List[int]]:
        out = {k: list(e["shape"]) for k, e in self._tensors.items()}
        out.update({k: [] for k in self._strings})
        return out

    def get_variable_to_dtype_map(self) -> Dict[str, tf.DType]:
        out = {k: tf.as_dtype(e["dtype"]) for k, e in self._tensors.items()}
        out.update({k: tf.string for k in self._strings})
        return out

    def get_tensor(self, key: str) -> Any:
        if key in self._strings:
            return base64.b64decode(self._strings[key])
        if key not in self._tensors:
            raise KeyError(f"{key!r} is not in checkpoint {self.prefix!r}")
        entry = self._tensors[key]
        view = memoryview(self._buffer())[entry["offset"]:entry["offset"] + entry["nbytes"]]
        if zlib.crc32(view) != entry["crc32"]:
            raise CorruptCheckpointError(f"{self.prefix}: tensor {key!r} fails its CRC check (the data file is "
                                         "damaged)")
        dtype = tf.as_dtype(entry["dtype"]).as_numpy_dtype
        return np.frombuffer(view, dtype=dtype).reshape(entry["shape"]).copy()

    def keys(self) -> Iterable[str]:
        return list(self._tensors) + list(self._strings)


def files_identity(prefix: str) -> Optional[tuple]:
    """What tells two writes of checkpoint ``prefix`` apart: the (inode, size, mtime) of its index and every data
    shard (a save writes new files and renames them over the old names); ``None`` when they cannot be stat'ed."""
    paths = [prefix + ".index"] + data_files(prefix)
    out = []
    for path in paths:
        try:
            if is_local(path):
                st = os.stat(path)
                out.append((st.st_ino, st.st_size, st.st_mtime_ns))
            else:
                st = tf.io.gfile.stat(path)
                out.append((st.length, st.mtime_nsec))
        except (OSError, tf.errors.OpError):
            return None
    return tuple(out) if len(out) > 1 else None


_GLOB_CHARS = "*?[\\"  # what TensorFlow's GetMatchingPaths treats as a pattern (its readers glob the prefix)


class _PatternFreePrefix:
    """A name for checkpoint ``prefix`` that TensorFlow's readers take literally. ``tf.train.load_checkpoint`` and
    ``RestoreV2`` look the prefix up as a glob pattern, so a directory named ``exp[1]`` reads as "no matching
    files"; on Linux the directory is opened and named through ``/proc/self/fd/N`` (held open as long as this
    object lives), so nothing is renamed, copied or left behind."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        directory, base = os.path.split(prefix)
        if (is_local(prefix) and any(c in directory for c in _GLOB_CHARS) and not any(c in base for c in _GLOB_CHARS)
                and os.path.isdir("/proc/self/fd")):
            import weakref

            fd = os.open(directory or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            self.prefix = f"/proc/self/fd/{fd}/{base}"
            weakref.finalize(self, os.close, fd)


class BundleReader:
    """``tf.train.load_checkpoint``'s reader whose failures to read a tensor (TensorFlow's CRC32C check: "Checksum
    does not match", a truncated file) are :class:`CorruptCheckpointError`, naming the checkpoint and the key.

    Example:
        BundleReader("ckpt/ckpt-300").get_tensor("model_variables/0/.ATTRIBUTES/VARIABLE_VALUE")
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.identity = files_identity(prefix)  # (before opening: a rewrite after this shows as a change)
        self._literal = _PatternFreePrefix(prefix)  # (TensorFlow's reader globs the prefix)
        self.read_prefix = self._literal.prefix
        self._reader = tf.train.load_checkpoint(self.read_prefix)
        # TensorFlow opens the data file at the first read: open it now (read the smallest tensor), so a reader
        # keeps this checkpoint's bytes even if training deletes the files before it reads the rest
        shapes = self._reader.get_variable_to_shape_map()
        if shapes:
            self.get_tensor(min(shapes, key=lambda k: int(np.prod(shapes[k] or [1]))))

    def has_tensor(self, key: str) -> bool:
        return self._reader.has_tensor(key)

    def get_variable_to_shape_map(self) -> Dict[str, List[int]]:
        return self._reader.get_variable_to_shape_map()

    def get_variable_to_dtype_map(self) -> Dict[str, tf.DType]:
        return self._reader.get_variable_to_dtype_map()

    def get_tensor(self, key: str) -> Any:
        if not self._reader.has_tensor(key):
            raise KeyError(f"{key!r} is not in checkpoint {self.prefix!r}")
        try:
            return self._reader.get_tensor(key)
        except (tf.errors.OpError, RuntimeError, IndexError) as e:  # IndexError: a truncated data file
            raise CorruptCheckpointError(f"{self.prefix}: tensor {key!r} cannot be read: "
                                         f"{(str(e).splitlines() or [''])[0]}") from e


def read_checkpoint(prefix: str) -> Any:
    """A reader for checkpoint ``prefix`` (``has_tensor``, ``get_tensor``, ``get_variable_to_shape_map``,
    ``get_variable_to_dtype_map``): :class:`BundleReader` over ``tf.train.load_checkpoint``'s, which checks each tensor's CRC32C as it reads
    it and returns a copy (a later save never changes an array you hold). Checkpoints of earlier keras_scale
    versions are read by :class:`LegacyReader`.

    Example:
        read_checkpoint("ckpt/ckpt-300").get_tensor("keras_scale_signature/.ATTRIBUTES/VARIABLE_VALUE")
    """
    if is_raw(prefix):
        return LegacyReader(prefix)
    return BundleReader(prefix)


load_checkpoint = read_checkpoint  # the name earlier versions used


def read_into(prefix: str, variables: Dict[str, Any], tf_checkpoint: Any = None) -> None:
    """Restore checkpoint ``prefix`` into ``variables`` (``{key: variable}``).

    Keys the checkpoint lacks are left alone and keys it has beyond ``variables`` are ignored (as
    ``expect_partial``). Every entry's dtype and shape are compared with its variable, and every tensor of the
    checkpoint is read (CRC-checked) before the first one is assigned: a mismatch is a ``ValueError`` naming the key, damage a
    :class:`CorruptCheckpointError`; either way no variable has changed.
    (``tf_checkpoint`` is accepted for older callers and not used.)

    Example:
        read_into("ckpt/ckpt-300", flatten(items))
    """
    reader = read_checkpoint(prefix)
    dtypes = reader.get_variable_to_dtype_map()
    shapes = reader.get_variable_to_shape_map()
    present = [(key, variable) for key, variable in variables.items() if key in dtypes]
    for key, variable in present:
        ours = tf.as_dtype(variable.dtype).base_dtype
        if dtypes[key].base_dtype != ours:
            raise ValueError(f"checkpoint {prefix!r}: {key!r} has dtype {dtypes[key].name} there but the variable "
                             f"{getattr(variable, 'name', key)!r} has dtype {ours.name}; nothing was restored")
        theirs, mine = tuple(shapes[key]), tuple(int(d) for d in variable.shape)
        if theirs != mine:
            raise ValueError(f"checkpoint {prefix!r}: {key!r} has shape {theirs} there but the variable has shape "
                             f"{mine}; nothing was restored")
    keys = [key for key, _ in present]
    rest = sorted(set(dtypes) - set(variables))  # the rest (object graph, counters): the whole checkpoint is intact
    values = _read_all(reader, prefix, keys + rest, dtypes, shapes)
    for (_, variable), value in zip(present, values):
        _assign(variable, value)


_PARALLEL_READ_BYTES = 16 << 20  # a bundle this large is read by several RestoreV2 ops at once


def _read_all(reader: Any, prefix: str, keys: List[str], dtypes: Dict[str, Any],
              shapes: Dict[str, List[int]]) -> List[Any]:
    """Every tensor of ``keys``, CRC-checked, in order. A bundle is read by ``RestoreV2`` ops (TensorFlow's reader,
    which checks each tensor's CRC32C, straight into tensors: no per-key Python call, no NumPy copy): one, or one per
    CPU core (up to 4) on groups of equal bytes when it holds over 16 MiB (a RestoreV2 reads its tensors one after
    another). If one fails, the per-key reads of ``reader`` name the damaged tensor; if the files were replaced
    since ``reader`` opened them, its per-key reads return the checkpoint it opened (never a mix of two)."""
    if isinstance(reader, BundleReader) and keys and reader.identity is not None:
        try:
            values = _restore_v2(reader.read_prefix, keys, dtypes, shapes)
            # RestoreV2 opens the files by name: a save at the same prefix since the reader opened them (another
            # process reading while training writes) would give another checkpoint's tensors, or a mix of two
            if files_identity(prefix) == reader.identity:
                return values
        except (tf.errors.OpError, RuntimeError, ValueError):
            pass  # (damaged, or deleted since the reader opened it: the reader still holds its bytes)
    return [reader.get_tensor(key) for key in keys]  # CRC-checked, copies, of the files the reader opened


def _restore_v2(prefix: str, keys: List[str], dtypes: Dict[str, Any], shapes: Dict[str, List[int]]) -> List[Any]:
    def read(group: List[str]) -> List[Any]:
        with tf.device("/cpu:0"):
            return list(tf.raw_ops.RestoreV2(prefix=prefix, tensor_names=group, shape_and_slices=[""] * len(group),
                                             dtypes=[dtypes[k] for k in group]))

    sizes = {k: int(np.prod(shapes.get(k) or [1])) * max(tf.as_dtype(dtypes[k]).size, 1) for k in keys}
    num_groups = min(4, os.cpu_count() or 1, len(keys))
    if num_groups < 2 or sum(sizes.values()) < _PARALLEL_READ_BYTES:
        return read(keys)
    groups: List[List[str]] = [[] for _ in range(num_groups)]
    totals = [0] * num_groups
    for key in sorted(keys, key=lambda k: -sizes[k]):  # largest first onto the lightest group
        i = totals.index(min(totals))
        groups[i].append(key)
        totals[i] += sizes[key]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(num_groups, thread_name_prefix="keras_scale_restore") as pool:
        parts = list(pool.map(read, groups))  # (an op's error is raised here)
    values = {k: v for group, part in zip(groups, parts) for k, v in zip(group, part)}
    return [values[k] for k in keys]


def _assign(variable: Any, value: Any) -> None:
    """Assign like TensorFlow's checkpoint restore: a distributed variable gets the value on each of its
    components directly (no cross-replica update, so no collective), a sync-on-read SUM variable its share."""
    from tensorflow.python.distribute import distribute_utils

    if not distribute_utils.is_distributed_variable(variable):
        variable.assign(value)
        return
    tensor = tf.convert_to_tensor(value, dtype=variable.dtype)
    if distribute_utils.is_sync_on_read(variable) and variable.aggregation == tf.VariableAggregation.SUM:
        tensor = tf.cast(tensor / variable.distribute_strategy.num_replicas_in_sync, variable.dtype)
    for component in variable.values:
        with tf.device(component.device):
            component.assign(tensor)
