"""Using ChiefCheckpoint's checkpoints outside training: load one into a model by variable path, list a directory,
export to Keras's own files.

Example:
    model = make_model()
    ks.load_checkpoint(model, "runs/exp1/ckpt")   # 'runs/exp1/ckpt/ckpt-3000'
    model.save("exp1.keras")
"""
from __future__ import annotations

import json
import os
import re
import shlex
import warnings
from typing import Any, Dict, List, Optional, Tuple, Union

import keras
import tensorflow as tf

from keras_scale.callbacks.checkpoint.directory import _scan, _verified, list_checkpoints, orphans
from keras_scale.callbacks.checkpoint.format import CorruptCheckpointError, _assign, read_checkpoint
from keras_scale.callbacks.checkpoint.names import (_BEST_DIR, _NAME, _POSITION, _RUN_CONFIG_KEY, _SIGNATURE_KEY,
                                                   CheckpointMismatchError)

__all__ = ["load_checkpoint", "load_optimizer_state", "resolve_checkpoint", "describe_directory"]

_MODEL_KEY = "model_variables/{}/.ATTRIBUTES/VARIABLE_VALUE"


def resolve_checkpoint(path: Union[str, os.PathLike], step: Optional[int] = None) -> str:
    """The checkpoint prefix ``path`` names: a prefix (``ckpt/ckpt-300``) as it is, a ChiefCheckpoint directory its
    newest committed checkpoint (or the one numbered ``step``, also among ``best/``).

    Example:
        resolve_checkpoint("ckpt")            # 'ckpt/ckpt-300'
        resolve_checkpoint("ckpt", step=200)  # 'ckpt/ckpt-200'
    """
    path = os.fspath(path)
    if tf.io.gfile.isdir(path):
        found = list_checkpoints(path)
        best = os.path.join(path, _BEST_DIR)
        if step is not None:
            for number, prefix in found + (list_checkpoints(best) if tf.io.gfile.isdir(best) else []):
                if number == step:
                    return prefix
            candidate = os.path.join(best, f"{_NAME}-{step}")
            if tf.io.gfile.exists(candidate + ".index"):
                return candidate
            raise FileNotFoundError(f"no checkpoint {step} in {path!r} (it has {[n for n, _ in found] or 'none'}). "
                                    "Fix: pass one of those steps, or none for the newest.")
        if not found:
            in_best = [n for n, _ in (list_checkpoints(best) if tf.io.gfile.isdir(best) else [])]
            final = os.path.join(path, _FINAL_DIR)
            in_final = [n for n, _ in (list_checkpoints(final) if tf.io.gfile.isdir(final) else [])]
            hint = ""
            if in_best:
                hint += (f" Its best/ holds {', '.join(f'{_NAME}-{n}' for n in in_best)} (keep_best_k): pass "
                         f"{best!r} (the newest of them), step={in_best[0]}, or a prefix such as "
                         f"{os.path.join(best, f'{_NAME}-{in_best[0]}')!r}.")
            if in_final:
                hint += (f" Its final/ holds {', '.join(f'{_NAME}-{n}' for n in in_final)} (a completed run's final "
                         "weights), which load only beside the checkpoint of the same number in the directory (it "
                         "records their variable paths), now gone.")
            raise FileNotFoundError(f"{path!r} holds no checkpoint (no ckpt-N.index recorded or found).{hint} "
                                    "Fix: pass the directory given to ChiefCheckpoint, or a checkpoint prefix such as "
                                    f"{os.path.join(path, _NAME + '-100')!r}.")
        return found[0][1]
    if path.endswith(".index"):
        path = path[: -len(".index")]
    if not tf.io.gfile.exists(path + ".index"):
        raise FileNotFoundError(f"{path!r} is neither a checkpoint directory nor a checkpoint prefix (no "
                                f"{path + '.index'!r}).")
    return path


def _normalized(paths: List[str], strip_shared: bool = True) -> List[str]:
    """``paths`` without Keras's automatic numbering (``dense_1`` -> ``dense``) and (``strip_shared``) without a
    first component that all of them share (a Sequential model's own name: ``sequential_3/dense/kernel`` ->
    ``dense/kernel``)."""
    split = [p.split("/") for p in paths]
    if strip_shared and split and all(len(parts) > 1 for parts in split) and len({parts[0] for parts in split}) == 1:
        split = [parts[1:] for parts in split]
    return ["/".join(re.sub(r"_\d+$", "", part) for part in parts) for parts in split]


def _keyed(paths: List[str]) -> List[Tuple[str, int]]:
    """Each path with its occurrence number among equal paths (so equal names map in their order)."""
    seen: Dict[str, int] = {}
    out = []
    for p in paths:
        out.append((p, seen.get(p, 0)))
        seen[p] = seen.get(p, 0) + 1
    return out


_LOAD_TRIES = 5  # a directory's newest checkpoint rotated away before it was read: choose again, this many times


def _gone(prefix: str) -> bool:
    """Checkpoint ``prefix``'s index file is no longer there (training rotated it away)."""
    try:
        return not tf.io.gfile.exists(prefix + ".index")
    except (tf.errors.OpError, OSError):
        return True


_FINAL_DIR = "final"  # (boundaries.py: the weights a completed run's fit returned, EarlyStopping's restored best)


def final_weights_of(prefix: str) -> Optional[str]:
    """``directory/final/ckpt-N`` when checkpoint ``prefix`` (``directory/ckpt-N``) completed its run and recorded
    there the weights its ``fit`` returned (they differ from the checkpoint's own: ``EarlyStopping(
    restore_best_weights=True)``); else ``None``. What a rerun of the completed run restores.

    Example:
        final_weights_of("ckpt/ckpt-16")   # 'ckpt/final/ckpt-16'
    """
    try:
        reader = read_checkpoint(prefix)
        raw = reader.get_tensor(_RUN_CONFIG_KEY) if reader.has_tensor(_RUN_CONFIG_KEY) else b""
        config = json.loads(raw.decode() if isinstance(raw, bytes) else raw) if raw else {}
        relative = ((config.get("completed") if isinstance(config, dict) else None) or {}).get("final_weights")
    except Exception:  # noqa: BLE001 - no readable record: none
        return None
    if not isinstance(relative, str) or not re.fullmatch(_FINAL_DIR + "/" + _NAME + r"-\d+", relative):
        return None  # (never a file outside the directory)
    path = os.path.join(os.path.dirname(prefix), relative)
    return path if tf.io.gfile.exists(path + ".index") else None


def directory_of(prefix: str) -> str:
    """The directory checkpoint ``prefix`` is in."""
    return os.path.dirname(prefix)


def _signature_prefix(prefix: str) -> str:
    """The checkpoint whose variable paths ``prefix``'s model variables follow: ``dir/ckpt-N`` for
    ``dir/final/ckpt-N`` (the final weights are written in its order, without paths), else ``prefix``."""
    head, name = os.path.split(prefix)
    if os.path.basename(head) == _FINAL_DIR:
        return os.path.join(os.path.dirname(head), name)
    return prefix


def load_checkpoint(model: keras.Model, path: Union[str, os.PathLike], step: Optional[int] = None) -> str:
    """Load the model weights of a :class:`~keras_scale.ChiefCheckpoint` checkpoint into ``model``, matching
    variables by their path (``layer/kernel``), not by position: a Dropout's seed state or a reordered list of
    variables never shifts a weight into the wrong place. ``path`` is the checkpoint directory or one checkpoint's
    prefix. Paths are compared as saved; when the model's own name or Keras's automatic numbering differs
    (``dense_3`` in a process that built other models first), they are compared without them, each name's
    variables in their order. Every shape and dtype is checked and every tensor read (CRC-checked) before the first
    assignment. Only the model is loaded (not the optimizer); returns the prefix used.

    A directory without ``step`` loads what a rerun would restore: its newest checkpoint that reads back whole (a
    damaged newer one is skipped with a ``RuntimeWarning`` naming it, as ``fit`` skips it), and for a completed run
    that recorded the weights its ``fit`` returned (``EarlyStopping(restore_best_weights=True)``) those, from
    ``final/ckpt-N``. ``step=N`` (or a prefix) loads that checkpoint as it was saved, and a damaged one raises.

    Safe beside a training run (an evaluator loop): when ``path`` is a directory and its newest checkpoint is
    rotated away between being chosen and being read, the then newest one is chosen and read instead (up to 5
    tries; then a ``FileNotFoundError`` naming the directory). Nothing is assigned before a checkpoint was read
    whole, so a retry never leaves the model half-loaded.

    Example:
        model = make_model()
        ks.load_checkpoint(model, "ckpt")      # 'ckpt/ckpt-300'
        model.save_weights("model.weights.h5")
    """
    variables = list(model.variables)
    if not variables:
        raise ValueError("load_checkpoint: the model has no variables yet. Fix: build it first (a keras.Input as "
                         "its first layer, model.build(input_shape), or call it on one batch).")
    is_dir = tf.io.gfile.isdir(os.fspath(path))
    if not is_dir or step is not None:
        return _load_model_weights(model, variables, resolve_checkpoint(path, step))
    tried: List[str] = []
    skipped: List[str] = []
    last_damage: Optional[BaseException] = None
    while len(tried) < _LOAD_TRIES:
        prefix = resolve_checkpoint(path)  # the newest (raises, saying what to pass, when there is none)
        if prefix in skipped:  # damaged: the newest one not found damaged yet
            rest = [p for _, p in list_checkpoints(os.fspath(path)) if p not in skipped]
            if not rest:
                assert last_damage is not None
                raise last_damage
            prefix = rest[0]
        try:
            final = final_weights_of(prefix)
            if final is not None:
                why = _verified(prefix)
                if why is not None:  # a rerun cannot restore that completed state: it resumes an older checkpoint
                    raise CorruptCheckpointError(f"{prefix!r} (the completed run's last checkpoint) fails its check: "
                                                 f"{why}")
                try:
                    loaded = _load_model_weights(model, variables, final)
                except CorruptCheckpointError as e:  # the checkpoint's own weights, said (as a rerun does)
                    warnings.warn(f"load_checkpoint: the completed run's final weights {final!r} (what its fit "
                                  f"returned) cannot be read ({e}); loaded {prefix!r}'s own (its last epoch's) "
                                  "instead.", RuntimeWarning, stacklevel=2)
                else:
                    _warn_skipped(skipped, loaded)
                    return loaded
            loaded = _load_model_weights(model, variables, prefix)
            _warn_skipped(skipped, loaded)
            return loaded
        except CheckpointMismatchError:
            raise
        except Exception as e:  # noqa: BLE001 - rotated away (choose again), or damaged (the next older one)
            error = e
            if _gone(prefix):
                tried.append(os.path.basename(prefix))
                continue
            if not isinstance(e, (CorruptCheckpointError, tf.errors.OpError)):
                raise
            skipped.append(prefix)
            last_damage = e
    raise FileNotFoundError(
        f"load_checkpoint: {os.fspath(path)!r}: its newest checkpoint was deleted before it could be read, "
        f"{len(tried)} times ({', '.join(tried)}; training rotates checkpoints away: max_to_keep). Fix: retry, keep "
        f"more checkpoints (a larger max_to_keep) or save less often. Last error: {type(error).__name__}: "
        f"{(str(error).splitlines() or [''])[0][:200]}") from error


def _warn_skipped(skipped: List[str], loaded: str) -> None:
    if skipped:
        warnings.warn(f"load_checkpoint: {', '.join(repr(p) for p in skipped)} "
                      f"{'is' if len(skipped) == 1 else 'are'} damaged (fails its CRC check or cannot be read) and "
                      f"{'was' if len(skipped) == 1 else 'were'} skipped, as fit skips it; loaded {loaded!r}.",
                      RuntimeWarning, stacklevel=3)


def _load_model_weights(model: keras.Model, variables: List[Any], prefix: str) -> str:
    """The work of :func:`load_checkpoint` on one checkpoint ``prefix``: everything read, then assigned."""
    reader = read_checkpoint(prefix)
    signed = reader if reader.has_tensor(_SIGNATURE_KEY) else read_checkpoint(_signature_prefix(prefix))
    if not signed.has_tensor(_SIGNATURE_KEY):
        raise CheckpointMismatchError(f"{prefix!r} records no variable paths (not written by ChiefCheckpoint); "
                                      "load it with tf.train.Checkpoint(...).read instead.")
    raw = signed.get_tensor(_SIGNATURE_KEY)
    saved = [str(p) for p, _ in json.loads(raw.decode() if isinstance(raw, bytes) else raw)["model"]]
    ours = [getattr(v, "path", None) or v.name for v in variables]
    mapping: Optional[Dict[int, int]] = None
    # as saved; without numbering and a shared first component; that component stripped on one side only (a model
    # loaded from a .keras file has no model-name prefix on its paths: d/kernel for sequential/d/kernel)
    for mine, theirs in ((list, list), (_normalized, _normalized),
                         (lambda p: _normalized(p, strip_shared=False), _normalized),
                         (_normalized, lambda p: _normalized(p, strip_shared=False))):
        theirs_k, ours_k = _keyed(theirs(saved)), _keyed(mine(ours))
        if sorted(theirs_k) == sorted(ours_k) and len(set(ours_k)) == len(ours_k):
            where = {k: i for i, k in enumerate(theirs_k)}
            mapping = {j: where[k] for j, k in enumerate(ours_k)}
            break
    if mapping is None:
        def named(keys: Any) -> List[str]:  # equal names are told apart by their occurrence ("dense/kernel #3")
            return [p if n == 0 else f"{p} #{n + 1}" for p, n in sorted(keys)]

        mine_k, saved_k = set(_keyed(_normalized(ours))), set(_keyed(_normalized(saved)))
        missing, extra = named(mine_k - saved_k), named(saved_k - mine_k)
        raise CheckpointMismatchError(
            f"{prefix!r} holds {len(saved)} model variables, this model {len(ours)}; they do not match by path "
            f"(only in the model: {missing[:5]}; only in the checkpoint: {extra[:5]}). Fix: build the model the "
            "training script built (same layers, same names).")
    dtypes, shapes = reader.get_variable_to_dtype_map(), reader.get_variable_to_shape_map()
    plan = []
    for j, var in enumerate(variables):
        key = _MODEL_KEY.format(mapping[j])
        if key not in dtypes:
            raise CheckpointMismatchError(f"{prefix!r} lacks {key!r} ({ours[j]!r}); the checkpoint is incomplete.")
        if dtypes[key].base_dtype != tf.as_dtype(var.dtype).base_dtype or list(shapes[key]) != list(var.shape):
            raise CheckpointMismatchError(
                f"{prefix!r}: {saved[mapping[j]]!r} is {dtypes[key].name}{tuple(shapes[key])} there but "
                f"{ours[j]!r} is {tf.as_dtype(var.dtype).name}{tuple(var.shape)} here; nothing was loaded.")
        plan.append((var, key))
    values = [(var, reader.get_tensor(key)) for var, key in plan]  # all read (CRC-checked) before any assignment
    for var, value in values:
        _assign(getattr(var, "value", var) if isinstance(var, keras.Variable) else var, value)
    return prefix


_OPTIMIZER_KEY = "optimizer_variables/{}/.ATTRIBUTES/VARIABLE_VALUE"


def load_optimizer_state(model: keras.Model, path: Union[str, os.PathLike], step: Optional[int] = None) -> str:
    """Load the state of ``model.optimizer`` (``iterations``, moments, a float learning rate, a loss scale) from a
    :class:`~keras_scale.ChiefCheckpoint` checkpoint, so that a ``model.save("x.keras")`` afterwards carries the
    optimizer as training left it, not a fresh one. The optimizer must be the one the checkpoint was written with
    (same class, same variables and shapes, in order: the model compiled as the training script compiled it); it is
    built first if needed. Everything is read (CRC-checked) before the first assignment; a mismatch is a
    :class:`CheckpointMismatchError` naming both. Returns the prefix used.

    Example:
        model = make_model()               # compiled with the training script's optimizer
        ks.load_checkpoint(model, "ckpt")
        load_optimizer_state(model, "ckpt")
        model.save("exp1.keras")            # model.optimizer.iterations as in the checkpoint
    """
    from keras_scale.state import _class_name

    prefix = _signature_prefix(resolve_checkpoint(path, step))  # (final/ckpt-N: its checkpoint's optimizer)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        raise ValueError(f"load_optimizer_state: the model has no optimizer (not compiled); compile it as the "
                         f"training script did to load the optimizer state of {prefix!r}.")
    reader = read_checkpoint(prefix)
    if not reader.has_tensor(_SIGNATURE_KEY):
        raise CheckpointMismatchError(f"{prefix!r} records no signature (not written by ChiefCheckpoint).")
    raw = reader.get_tensor(_SIGNATURE_KEY)
    saved = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    theirs_class = ((saved.get("optimizers") or {}).get("optimizer") or {}).get("class")
    if theirs_class is not None and theirs_class != _class_name(optimizer):
        raise CheckpointMismatchError(f"{prefix!r} holds the state of a {theirs_class} optimizer; this model is "
                                      f"compiled with {_class_name(optimizer)}. Compile it as the training script did.")
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    ours = list(optimizer.variables)
    shapes = [list(shape) for _, shape in saved.get("optimizer", [])]
    if shapes != [[int(d) for d in v.shape] for v in ours]:
        raise CheckpointMismatchError(
            f"{prefix!r} holds {len(shapes)} optimizer variables of shapes {shapes[:6]}...; this model's "
            f"{_class_name(optimizer)} has {len(ours)} of shapes {[list(v.shape) for v in ours][:6]}.... Compile it "
            "as the training script did (same optimizer and options).")
    dtypes = reader.get_variable_to_dtype_map()
    for i, var in enumerate(ours):
        key = _OPTIMIZER_KEY.format(i)
        if key not in dtypes or dtypes[key].base_dtype != tf.as_dtype(var.dtype).base_dtype:
            raise CheckpointMismatchError(f"{prefix!r}: optimizer variable {i} ({var.name!r}) is missing or has "
                                          "another dtype there; nothing was loaded.")
    values = [(var, reader.get_tensor(_OPTIMIZER_KEY.format(i))) for i, var in enumerate(ours)]
    for var, value in values:
        _assign(getattr(var, "value", var) if isinstance(var, keras.Variable) else var, value)
    return prefix


def _size(prefix: str) -> int:
    directory, base = os.path.split(prefix)
    total = 0
    for name in tf.io.gfile.listdir(directory):
        if name == base + ".index" or name.startswith(base + ".data-"):
            total += tf.io.gfile.stat(os.path.join(directory, name)).length
    return total


def _position(prefix: str) -> Dict[str, int]:
    try:
        reader = read_checkpoint(prefix)
        return {n: int(reader.get_tensor(f"keras_scale_position/{n}/.ATTRIBUTES/VARIABLE_VALUE"))
                for n in _POSITION if reader.has_tensor(f"keras_scale_position/{n}/.ATTRIBUTES/VARIABLE_VALUE")}
    except Exception:  # noqa: BLE001 - unreadable index: shown as such
        return {}


def describe_directory(directory: str) -> Dict[str, Any]:
    """What ``keras-scale checkpoint ls`` prints: the committed checkpoints (number, position, bytes), which one a
    resumed ``fit`` starts from, whether the run completed there, the kept best ones, problems, orphan files and
    state files moved aside.

    Keys: ``checkpoints``, ``resumes`` (the prefix a rerun starts from, or ``None``), ``completed`` (``None``, or
    ``{"epoch", "reason", "prefix"}`` when that checkpoint ends a completed run: ``reason`` is ``"epochs"`` or
    ``"early_stopping"``; a rerun then restores it and trains 0 epochs), ``unlisted`` (complete checkpoints no
    resume uses and the next start keeps), ``best``, ``problems``, ``orphans`` (what the next start deletes),
    ``retired`` (checkpoints among the orphans: a rotation was deleting them when it was killed) and
    ``moved_aside`` (state files an earlier start moved aside, e.g. ``checkpoint.invalid``; never read or removed).

    The resume point is found as ``fit`` finds it: newest first, each checkpoint read whole (every tensor against its
    CRC32C, :func:`keras_scale.callbacks.checkpoint.format.verify_checkpoint`) until one loads; the ones it skips are
    problems. Complete checkpoints no resume uses (not in the state file: ``keep_every_n_hours``, an earlier run)
    are listed under ``unlisted``. A damaged ``best/best.json`` is a problem, never a crash.

    Example:
        describe_directory("ckpt")["resumes"]   # 'ckpt/ckpt-300'
    """
    from keras_scale.callbacks.checkpoint.best import BEST_JSON, EARLIER_RUN_PREFIX, ranked_in_best
    from keras_scale.callbacks.checkpoint.directory import (_retiring, _verified, completed_record, moved_aside,
                                                            unlisted_checkpoints)

    found, problems, _ = _scan(directory)
    problems = list(problems)
    rows = [{"number": n, "prefix": p, "bytes": _size(p), **_position(p)} for n, p in found]
    resumes = None
    for row in rows:
        why = _verified(row["prefix"])
        if why is None:
            resumes = row["prefix"]
            break
        row["damaged"] = why
        problems.append(f"{row['prefix']!r} fails its check ({why}): a resumed fit skips it")
    best_dir = os.path.join(directory, _BEST_DIR)
    best, _, best_problems = ranked_in_best(best_dir)  # (what fit ranks from: the entries whose files are there)
    best = best or []
    problems.extend(p + "; the next ChiefCheckpoint(keep_best_k=...) start rebuilds it from the checkpoints"
                    for p in best_problems)
    for e in best:
        e["prefix"] = os.path.join(best_dir, f"{_NAME}-{e.get('number')}")
    ranked = {e["number"] for e in best}
    for number, prefix in (list_checkpoints(best_dir) if tf.io.gfile.isdir(best_dir) else []):
        if number not in ranked:
            problems.append(f"{prefix!r} is in best/ but not ranked in {BEST_JSON} (the next ChiefCheckpoint"
                            "(keep_best_k=...) start ranks it by the value it records; it is never deleted unranked)")
    earlier_best = []  # best/earlier-run-to-ckpt-N/: an earlier run's best checkpoints, set aside by a new run
    for name in (sorted(tf.io.gfile.listdir(best_dir)) if tf.io.gfile.isdir(best_dir) else []):
        if name.startswith(EARLIER_RUN_PREFIX):
            aside = os.path.join(best_dir, name.rstrip("/"))
            earlier_best.append({"directory": aside, "checkpoints": sorted(n for n, _ in list_checkpoints(aside))})
    unlisted = [{"number": n, "prefix": p, "bytes": _size(p), **_position(p)} for n, p in unlisted_checkpoints(directory)]
    left = orphans(directory)
    retiring, _ = _retiring(directory)
    retired = sorted({os.path.join(directory, name) for name in retiring
                      if any(os.path.basename(p).startswith(name + ".") for p in left)})
    return {"directory": directory, "checkpoints": rows, "resumes": resumes,
            "completed": completed_record(resumes) if resumes else None, "unlisted": unlisted, "best": best,
            "earlier_best": earlier_best,
            "problems": problems, "orphans": left, "retired": retired, "moved_aside": moved_aside(directory)}


def _human(num_bytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1024 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return str(num_bytes)


def _build_model(spec: str) -> keras.Model:
    if spec.endswith(".keras"):
        try:  # compiled as saved: its optimizer then takes the checkpoint's state
            return keras.saving.load_model(spec)
        except Exception:  # noqa: BLE001 - e.g. a custom loss not importable here: the model alone
            return keras.saving.load_model(spec, compile=False)
    import importlib
    import sys

    module_name, _, function = spec.partition(":")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    model = getattr(importlib.import_module(module_name), function)()
    if not isinstance(model, keras.Model):
        raise ValueError(f"--model {spec!r} returned {type(model).__name__}, not a keras.Model")
    return model


def saved_at(epoch: int, step_in_epoch: int) -> str:
    """Where a checkpoint was taken, as Keras counts epochs (from 1). A checkpoint records where training continues
    (epoch ``epoch``, 0-based, after ``step_in_epoch`` batches): at batch 0 that is the end of the epoch before.

    Example:
        >>> saved_at(3, 0), saved_at(1, 16), saved_at(0, 0)
        ('the end of epoch 3', 'epoch 2, batch 16', 'the start')
    """
    if step_in_epoch == 0:
        return f"the end of epoch {epoch}" if epoch > 0 else "the start"
    return f"epoch {epoch + 1}, batch {step_in_epoch}"


def resumes_at(epoch: int, step_in_epoch: int) -> str:
    """Where a fit resumed from that checkpoint continues (Keras's numbering, from 1).

    Example:
        >>> resumes_at(3, 0)
        'continues at epoch 4, batch 1'
    """
    return f"continues at epoch {epoch + 1}, batch {step_in_epoch + 1}"


def _checkpoint_dirs_below(directory: str, max_depth: int = 3) -> List[str]:
    """Sub-directories of a local ``directory`` holding a ChiefCheckpoint's files (TensorFlow's ``checkpoint``
    state file or a ``ckpt-N.index``), nearest first: ``ls`` was probably given their parent (``runs/s1``)."""
    if not os.path.isdir(directory):
        return []
    found: List[str] = []
    base_depth = directory.rstrip(os.sep).count(os.sep)
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if d not in ("plugins", _BEST_DIR))
        if root.rstrip(os.sep).count(os.sep) - base_depth >= max_depth:
            dirs[:] = []
        if root != directory and ("checkpoint" in files or any(
                f.startswith(_NAME + "-") and f.endswith(".index") for f in files)):
            found.append(root)
            dirs[:] = []
    return sorted(found, key=lambda p: (p.count(os.sep), p))


def _checkpoint_dirs_recorded(log_dir: str) -> List[str]:
    """The checkpoint directories a run logged in ``log_dir`` (a TensorBoard log directory with keras_scale's
    ``events.jsonl``) saved into or resumed from, newest first, those still there only."""
    from keras_scale import events

    found: List[str] = []
    for e in reversed(events.read(log_dir)):
        where = e.get("directory") if e.get("kind") in ("checkpoint", "resume") else None
        if isinstance(where, str) and where not in found and os.path.isdir(where):
            found.append(where)
    return found


def cli(args: Any) -> int:
    """The work of ``keras-scale checkpoint ls|export`` (arguments parsed by :func:`keras_scale.cli.checkpoint_cli`)."""
    from keras_scale.output import say

    if args.action == "ls":
        info = describe_directory(args.directory)
        if args.json:
            print(json.dumps(info, indent=2, default=str))  # machine-readable: as it is
            return 0
        say(f"{args.directory}: {len(info['checkpoints'])} checkpoint(s)")
        if not info["checkpoints"]:
            below = _checkpoint_dirs_below(args.directory)
            if below:
                say(f"  the checkpoints are in {' and '.join(below[:3])}: "
                    f"keras-scale checkpoint ls {shlex.quote(below[0])}")
            else:
                recorded = _checkpoint_dirs_recorded(args.directory)
                if recorded:
                    say(f"  the run logged here saved its checkpoints in {' and '.join(recorded[:3])}: "
                        f"keras-scale checkpoint ls {shlex.quote(recorded[0])}")
        done = info.get("completed")
        if done:
            how = "stopped by EarlyStopping" if done["reason"] == "early_stopping" else "all its epochs trained"
            more = (f"; with a larger epochs= it continues at epoch {done['epoch'] + 1}" if done["reason"] == "epochs"
                    else "")
            say(f"  the run completed at epoch {done['epoch']} ({how}): a rerun (on_completed='restore', the "
                f"default) restores its final state from {_NAME}-{done['prefix'].rsplit('-', 1)[1]}"
                f"{' and ' + os.path.relpath(final_weights_of(done['prefix']), directory_of(done['prefix'])) if final_weights_of(done['prefix']) else ''} and trains 0 "
                f"epochs (with another learning rate it stops: RunCompletedError){more}; on_completed='restart' or "
                "another directory trains anew")
        final = final_weights_of(done["prefix"]) if done else None
        for row in info["checkpoints"]:
            where = saved_at(row["epoch"], row["step_in_epoch"]) if "epoch" in row else "position unknown"
            if row["prefix"] == info["resumes"] and done and final:
                mark = "  <- the completed run's last checkpoint (its final state's optimizer and position)"
            elif row["prefix"] == info["resumes"] and done:
                mark = "  <- the completed run's final state (a rerun restores it, 0 epochs)"
            elif row["prefix"] == info["resumes"]:
                mark = "  <- a resumed fit starts here" + (f" ({resumes_at(row['epoch'], row['step_in_epoch'])})"
                                                           if "epoch" in row else "")
            else:
                mark = ""
            say(f"  {_NAME}-{row['number']:<10} {'saved at ' + where:<33} {_human(row['bytes']):>10}{mark}")
        if final:
            say(f"  {os.path.relpath(final, info['directory'])}: the completed run's final state (the weights its fit "
                "returned, EarlyStopping's restored best; a rerun restores them, 0 epochs, and "
                "ks.load_checkpoint(model, directory) and export load them)")
        for e in info["best"]:
            epoch = f" (epoch {e['epoch'] + 1})" if isinstance(e.get("epoch"), int) else ""
            say(f"  best: {os.path.basename(e['prefix'])} {e.get('monitor') or 'value'}={e['value']:.6g}{epoch}")
        for aside in info.get("earlier_best", []):
            say(f"  best of an earlier run (set aside when a new run started; kept, never ranked): "
                f"{os.path.relpath(aside['directory'], info['directory'])}/ "
                f"({', '.join(f'{_NAME}-{n}' for n in aside['checkpoints']) or 'no checkpoint'})")
        for row in info["unlisted"]:  # (what a damaged newest one is: a problem line below)
            say(f"  {_NAME}-{row['number']:<10} not in the state file: kept (keep_every_n_hours, an earlier run); "
                "a resume never uses it")
        for problem in info["problems"]:
            say(f"  problem: {problem}")
        retired = [os.path.basename(p) for p in info.get("retired", [])]
        if retired:
            say(f"  {', '.join(retired)}: retired by a rotation a kill cut short (no longer in the state file); the "
                "next ChiefCheckpoint start deletes {}".format("it" if len(retired) == 1 else "them"))
        if info["orphans"]:
            say(f"  {len(info['orphans'])} orphan file(s) of killed writes or rotations (the next ChiefCheckpoint "
                "start deletes them): " + ", ".join(os.path.basename(p) for p in info["orphans"][:5]))
        for path in info.get("moved_aside", []):
            say(f"  {os.path.basename(path)}: a state file an earlier ChiefCheckpoint start could not use and moved "
                "aside (unparseable, or naming other places or missing files); nothing reads or removes it: delete "
                "it once you no longer need it")
        return 0
    model = _build_model(args.model)
    prefix = load_checkpoint(model, args.directory, step=args.step)
    if args.to.endswith(".weights.h5"):
        model.save_weights(args.to)
        say(f"wrote {args.to} from {prefix}")
        return 0
    note = ""
    if getattr(model, "optimizer", None) is None:
        note = (" (model weights only: the model from --model is not compiled, so the .keras file holds no "
                "optimizer; compile it in --model as the training script did to export the optimizer state too)")
    else:
        load_optimizer_state(model, _signature_prefix(prefix))  # (final/ckpt-N holds only the weights)
        note = (f" (with the optimizer state: {type(model.optimizer).__name__}, iterations "
                f"{int(model.optimizer.iterations.numpy())})")
    model.save(args.to)
    say(f"wrote {args.to} from {prefix}{note}")
    return 0
