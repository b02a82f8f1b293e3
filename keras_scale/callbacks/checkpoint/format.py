"""ChiefCheckpoint's own file format for synchronous saves: raw tensor bytes plus a JSON index.

Why not TensorFlow's tensor bundle (``tf.train.Checkpoint.write``): it copies every tensor into an 8 MB buffer,
checksums it with CRC32C and always writes new files; on this kind of machine most of a save is the kernel
allocating page-cache pages for a new 0.5 GB file. Here a save

* reads each variable without a copy (``memoryview`` of the CPU tensor; a device tensor is copied to the host),
* writes the bytes with ``pwrite`` straight from that buffer into a *recycled* file -- the data file of a
  checkpoint that rotation just retired (``max_to_keep``) -- so its page-cache pages are overwritten in place
  instead of being freed and allocated again (databases recycle their log segments for the same reason),
* checksums each tensor with ``zlib.crc32`` while it is hot in the CPU cache,
* makes the checkpoint appear atomically: the data file is renamed to ``<prefix>.data-00000-of-00001``, then the
  index is written to a temporary name and renamed to ``<prefix>.index``. The checkpoint counts only once the
  ``checkpoint`` state file names it (written by ``tf.train.CheckpointManager`` after both renames), exactly as
  before. A process killed at any moment leaves the previous checkpoint usable.

Durability: nothing is fsynced (the same as TensorFlow's and Keras's savers). A checkpoint survives the death of
the process (the kernel holds its pages and writes them back within ~30 s) but not necessarily a power loss or
kernel crash shortly after a save; a checkpoint torn that way fails its size or CRC check on restore and the
previous one is used. ``write_checkpoint(..., fsync=True)`` flushes data, index and directory before returning.

Restore memory-maps the data file, checks every tensor's CRC before assigning any (a damaged checkpoint never
half-overwrites the model) and assigns from the mapped pages. Checkpoints written by TensorFlow (older versions
of ChiefCheckpoint, and ``async_save=True``) are read by TensorFlow as before; :func:`load_checkpoint` tells them
apart by the index file's first byte.

Example:
    reader = load_checkpoint("ckpt/ckpt-300")
    reader.get_tensor("keras_scale_position/global_step/.ATTRIBUTES/VARIABLE_VALUE")
    # array(300)
"""
from __future__ import annotations

import base64
import json
import mmap
import os
import uuid
import zlib
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np
import tensorflow as tf

from keras_scale.callbacks.checkpoint.storage import is_local

__all__ = ["FORMAT", "CorruptCheckpointError", "RawCheckpoint", "RecyclingCheckpointManager", "flatten",
           "is_raw", "load_checkpoint", "read_into", "write_checkpoint"]

FORMAT = "keras_scale.raw/1"
DATA_SUFFIX = ".data-00000-of-00001"
SPARE_PREFIX = ".ks_spare_"  # a retired data file kept for the next save to overwrite in place
_ALIGN_BYTES = 64
_CHUNK_BYTES = 4 << 20  # checksum and write in pieces that stay in the CPU cache in between
_MAX_SPARES = 2
_ATTR = ".ATTRIBUTES/VARIABLE_VALUE"


class CorruptCheckpointError(OSError):
    """A checkpoint file is truncated, torn or damaged (size, JSON or CRC check failed)."""


_local = is_local  # (storage.is_local: a path of the local file system, not a URL)


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


# ------------------------------------------------------------------------------------------------ writing
def _host_buffer(variable: Any) -> Tuple[np.ndarray, memoryview]:
    """The variable's value as a host numpy array and a byte view of it, without a copy on CPU."""
    value = variable.read_value() if hasattr(variable, "read_value") else tf.convert_to_tensor(variable)
    array = np.asarray(value)  # zero-copy for a CPU tensor (TensorFlow's __array__); device tensors come to the host
    return array, memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))  # any dtype, as bytes


def _take_spare(directory: str) -> Optional[str]:
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith(SPARE_PREFIX))
    except OSError:
        return None
    for name in names:
        path = os.path.join(directory, name)
        if os.path.isfile(path) and not os.path.islink(path):
            return path
    return None


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(prefix: str, variables: Dict[str, Any], fsync: bool = False) -> Dict[str, Any]:
    """Write ``variables`` (``{key: variable}``) as checkpoint ``prefix`` (``<prefix>.index`` +
    ``<prefix>.data-00000-of-00001``); returns the index. Numeric tensors go to the data file, string scalars
    into the index.

    Example:
        write_checkpoint("/tmp/ck/ckpt-1", flatten({"w": model.variables}))
    """
    directory = os.path.dirname(prefix) or "."
    tensors: Dict[str, Any] = {}
    strings: Dict[str, str] = {}
    buffers: List[Tuple[int, memoryview]] = []
    offset = 0
    for key, variable in variables.items():
        dtype = tf.as_dtype(variable.dtype)
        if dtype == tf.string:
            raw = variable.numpy()
            raw = raw if isinstance(raw, bytes) else str(raw).encode()
            strings[key] = base64.b64encode(raw).decode("ascii")
            continue
        array, view = _host_buffer(variable)
        offset = -(-offset // _ALIGN_BYTES) * _ALIGN_BYTES
        tensors[key] = {"dtype": dtype.name, "shape": [int(d) for d in array.shape], "offset": offset,
                        "nbytes": view.nbytes}
        buffers.append((offset, view))
        offset += view.nbytes
    total = offset
    keys = [k for k in tensors]
    data_path = prefix + DATA_SUFFIX
    if _local(prefix):
        path = _take_spare(directory) or os.path.join(directory, f"{SPARE_PREFIX}{uuid.uuid4().hex}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            for key, (start, view) in zip(keys, buffers):
                crc = 0
                for i in range(0, view.nbytes, _CHUNK_BYTES):
                    piece = view[i:i + _CHUNK_BYTES]
                    crc = zlib.crc32(piece, crc)
                    written = 0
                    while written < piece.nbytes:
                        written += os.pwrite(fd, piece[written:], start + i + written)
                tensors[key]["crc32"] = crc
            os.ftruncate(fd, total)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(path, data_path)
    else:  # object stores: one sequential write, no recycling
        with tf.io.gfile.GFile(data_path, "wb") as f:
            position = 0
            for key, (start, view) in zip(keys, buffers):
                if start > position:
                    f.write(b"\0" * (start - position))
                f.write(view.tobytes())
                tensors[key]["crc32"] = zlib.crc32(view)
                position = start + view.nbytes
    del buffers
    index = {"format": FORMAT, "data_bytes": total, "tensors": tensors, "strings": strings}
    text = json.dumps(index, separators=(",", ":"))
    tmp = prefix + ".index.ks_tmp"
    with tf.io.gfile.GFile(tmp, "w") as f:
        f.write(text)
    if fsync and _local(prefix):
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    tf.io.gfile.rename(tmp, prefix + ".index", overwrite=True)
    if fsync and _local(prefix):
        _fsync_dir(directory)
    return index


class RawCheckpoint:
    """Stands in for a ``tf.train.Checkpoint`` inside a ``tf.train.CheckpointManager`` so that the manager's
    numbering, state file and rotation stay as they are while the bytes are written by :func:`write_checkpoint`.

    Example:
        manager = RecyclingCheckpointManager(RawCheckpoint(tf_ckpt, flatten(items)), "ckpt")
        manager.save(checkpoint_number=100)
    """

    def __init__(self, tf_checkpoint: tf.train.Checkpoint, variables: Dict[str, Any], fsync: bool = False) -> None:
        self._tf_checkpoint = tf_checkpoint
        self.variables = variables
        self.fsync = fsync

    @property
    def save_counter(self) -> tf.Variable:
        return self._tf_checkpoint.save_counter

    def _write(self, file_prefix: str, options: Any = None, write_done_callback: Any = None) -> str:
        write_checkpoint(file_prefix, self.variables, fsync=self.fsync)
        for callback in list(getattr(options, "experimental_write_callbacks", None) or []):
            callback(file_prefix)
        if write_done_callback is not None:
            write_done_callback(file_prefix)
        return file_prefix

    write = _write

    def sync(self) -> None:
        """Nothing to wait for: :meth:`_write` returns once the checkpoint is complete."""


class RecyclingCheckpointManager(tf.train.CheckpointManager):
    """A ``tf.train.CheckpointManager`` whose rotation keeps one retired data file (not hard-linked elsewhere,
    e.g. into ``best/``) as a spare that the next :func:`write_checkpoint` overwrites in place.

    Example:
        manager = RecyclingCheckpointManager(RawCheckpoint(tf_ckpt, variables), "ckpt", max_to_keep=2)
    """

    recycle = True

    def _sweep(self) -> None:  # the loop of tf.train.CheckpointManager._sweep, discarding through _discard
        if not self._max_to_keep:
            return
        while len(self._maybe_delete) > self._max_to_keep:
            filename, timestamp = self._maybe_delete.popitem(last=False)
            if (self._keep_checkpoint_every_n_hours
                    and (timestamp - self._keep_checkpoint_every_n_hours * 3600.
                         >= self._last_preserved_timestamp)):
                self._last_preserved_timestamp = timestamp
                continue
            self._discard(filename)

    def _discard(self, prefix: str) -> None:
        for path in tf.io.gfile.glob(prefix + ".index"):
            tf.io.gfile.remove(path)
        directory = os.path.dirname(prefix) or "."
        for path in tf.io.gfile.glob(prefix + ".data-?????-of-?????"):
            if self.recycle and _local(path) and _count_spares(directory) < _MAX_SPARES:
                try:
                    st = os.lstat(path)
                    if st.st_nlink == 1 and os.path.isfile(path) and not os.path.islink(path):
                        os.rename(path, os.path.join(directory, f"{SPARE_PREFIX}{uuid.uuid4().hex}"))
                        continue
                except OSError:
                    pass
            try:
                tf.io.gfile.remove(path)
            except tf.errors.NotFoundError:
                pass


def _count_spares(directory: str) -> int:
    try:
        return sum(1 for n in os.listdir(directory) if n.startswith(SPARE_PREFIX))
    except OSError:
        return 0


def remove_spares(directory: str) -> None:
    """Delete the spare data files kept for recycling in ``directory`` (they hold no checkpoint).

    Example:
        remove_spares("ckpt")
    """
    if not _local(directory):
        return
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if name.startswith(SPARE_PREFIX) or name.endswith(".index.ks_tmp"):
            path = os.path.join(directory, name)
            if os.path.isfile(path) or os.path.islink(path):
                try:
                    os.remove(path)
                except OSError:
                    pass


# ------------------------------------------------------------------------------------------------ reading
def is_raw(prefix: str) -> bool:
    """True when ``prefix`` was written by :func:`write_checkpoint` (its index is JSON, TensorFlow's is a table).

    Example:
        is_raw("ckpt/ckpt-300")  # True
    """
    try:
        with tf.io.gfile.GFile(prefix + ".index", "rb") as f:
            return f.read(1) == b"{"
    except (tf.errors.OpError, OSError):
        return False


class RawReader:
    """Reads a :func:`write_checkpoint` checkpoint with the interface of ``tf.train.load_checkpoint``'s reader.

    Tensors come back as read-only arrays over the memory-mapped data file, each checked against its CRC.

    Example:
        RawReader("ckpt/ckpt-300").get_variable_to_shape_map()
        # {'model_variables/0/.ATTRIBUTES/VARIABLE_VALUE': [2048, 2048], ...}
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        try:
            with tf.io.gfile.GFile(prefix + ".index", "rb") as f:
                self._index = json.loads(f.read().decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptCheckpointError(f"{prefix}.index is not a readable checkpoint index ({e})") from e
        if not isinstance(self._index, dict) or self._index.get("format") != FORMAT:
            raise CorruptCheckpointError(f"{prefix}.index is not a {FORMAT} index (format "
                                         f"{self._index.get('format') if isinstance(self._index, dict) else None!r})")
        self._tensors: Dict[str, Dict[str, Any]] = self._index["tensors"]
        self._strings: Dict[str, str] = self._index["strings"]
        self._data: Any = None
        self._checked: set = set()

    def _buffer(self) -> Any:
        if self._data is None:
            path = self.prefix + DATA_SUFFIX
            expected = int(self._index["data_bytes"])
            if _local(path):
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if size != expected:
                        raise CorruptCheckpointError(f"{path} holds {size} bytes, its index says {expected}: the "
                                                     "file is truncated or torn")
                    self._data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
            else:
                with tf.io.gfile.GFile(path, "rb") as f:
                    self._data = f.read()
                if len(self._data) != expected:
                    raise CorruptCheckpointError(f"{path} holds {len(self._data)} bytes, its index says {expected}")
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
        dtype = tf.as_dtype(entry["dtype"]).as_numpy_dtype
        view = memoryview(self._buffer())[entry["offset"]:entry["offset"] + entry["nbytes"]]
        if key not in self._checked:
            if zlib.crc32(view) != entry["crc32"]:
                raise CorruptCheckpointError(f"{self.prefix}: tensor {key!r} fails its CRC check (the data file is "
                                             "damaged)")
            self._checked.add(key)
        return np.frombuffer(view, dtype=dtype).reshape(entry["shape"])

    def keys(self) -> Iterable[str]:
        return list(self._tensors) + list(self._strings)


def load_checkpoint(prefix: str) -> Any:
    """A reader for checkpoint ``prefix`` in either format (``has_tensor``, ``get_tensor``,
    ``get_variable_to_shape_map``): :class:`RawReader` for ChiefCheckpoint's synchronous saves,
    ``tf.train.load_checkpoint`` for TensorFlow-written ones.

    Example:
        load_checkpoint("ckpt/ckpt-300").get_tensor("keras_scale_signature/.ATTRIBUTES/VARIABLE_VALUE")
    """
    if is_raw(prefix):
        return RawReader(prefix)
    return tf.train.load_checkpoint(prefix)


def read_into(prefix: str, variables: Dict[str, Any], tf_checkpoint: Any) -> None:
    """Restore checkpoint ``prefix`` into ``variables`` (``{key: variable}``); a TensorFlow-written checkpoint is
    read by ``tf_checkpoint`` (the ``tf.train.Checkpoint`` over the same variables) instead.

    Keys the checkpoint lacks are left alone and keys it has beyond ``variables`` are ignored (as
    ``expect_partial``). Every tensor's size and CRC are checked before the first one is assigned.

    Example:
        read_into("ckpt/ckpt-300", flatten(items), tf.train.Checkpoint(**items))
    """
    if not is_raw(prefix):
        tf_checkpoint.read(prefix).expect_partial()
        return
    reader = RawReader(prefix)
    plan = []
    for key, variable in variables.items():
        if not reader.has_tensor(key):
            continue
        value = reader.get_tensor(key)  # checks the CRC
        if key in reader._tensors:
            theirs = tuple(value.shape)
            ours = tuple(int(d) for d in variable.shape)
            if theirs != ours:
                raise ValueError(f"checkpoint {prefix!r}: {key!r} has shape {theirs} there but the variable has shape "
                                 f"{ours}")
        plan.append((variable, value))
    for variable, value in plan:
        _assign(variable, value)


def _assign(variable: Any, value: Any) -> None:
    """Assign like TensorFlow's checkpoint restore: a distributed variable gets the value on each of its
    components directly (no cross-replica update, so no collective), a sync-on-read SUM variable its share."""
    from tensorflow.python.distribute import distribute_utils

    if not distribute_utils.is_distributed_variable(variable):
        variable.assign(value)  # TensorFlow copies into the variable's own buffer (no alias of the mapped file)
        return
    tensor = tf.convert_to_tensor(value, dtype=variable.dtype)
    if distribute_utils.is_sync_on_read(variable) and variable.aggregation == tf.VariableAggregation.SUM:
        tensor = tf.cast(tensor / variable.distribute_strategy.num_replicas_in_sync, variable.dtype)
    for component in variable.values:
        with tf.device(component.device):
            component.assign(tensor)
