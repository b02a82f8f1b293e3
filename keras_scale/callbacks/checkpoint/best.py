"""keep_best_k: the best epoch-end checkpoints by a monitored log, kept in ``directory/best``.

``best/best.json`` is an index, not the record: every epoch-end checkpoint holds its epoch's logs (the monitored
value included), so the ranking is rebuilt from the checkpoints themselves whenever ``best.json`` is missing,
damaged or behind (a kill after an epoch-end save and before ``best.json`` was written). A checkpoint in ``best/``
whose value cannot be read is kept, with a warning, never deleted.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from typing import Any, Dict, List, Optional, Tuple

import tensorflow as tf

from keras_scale.callbacks.checkpoint.names import _BEST_DIR, _EPOCH_LOGS_KEY, _INDEX_RE, _NAME, _POSITION
from keras_scale.callbacks.checkpoint.format import is_complete, read_checkpoint, remove_entry
from keras_scale.storage import _is_local, write_atomic

BEST_JSON = "best.json"
#: best/<this><step>/: an earlier run's best checkpoints, set aside when a new run started after ckpt-<step>
EARLIER_RUN_PREFIX = "earlier-run-to-ckpt-"


def read_best_json(best_dir: str) -> Tuple[Optional[List[Dict[str, Any]]], Optional[str]]:
    """``(valid entries, problem)`` of ``best_dir/best.json``: entries ``{"number", "value", "epoch", "monitor"}``
    whose number is an int and whose value a finite number; ``None`` when the file is missing; a problem (naming
    the file) when it cannot be parsed, is not a list, or has entries that are not such dicts (those are left out).

    Example:
        read_best_json("ckpt/best")   # ([{'number': 30, 'value': 0.031, 'epoch': 2, 'monitor': 'val_loss'}], None)
    """
    path = os.path.join(best_dir, BEST_JSON)
    try:
        with tf.io.gfile.GFile(path, "rb") as f:
            raw = f.read()
    except (tf.errors.NotFoundError, FileNotFoundError):
        return None, None
    except (tf.errors.OpError, OSError) as e:
        return [], f"{path!r} cannot be read ({e})"
    try:
        entries = json.loads(raw.decode("utf-8"))
    except ValueError as e:  # (UnicodeDecodeError included: bytes that are not text)
        return [], f"{path!r} is damaged (not JSON: {e}; truncated?)"
    if not isinstance(entries, list):
        return [], f"{path!r} is damaged (a JSON {type(entries).__name__}, not a list of entries)"
    good, bad = [], 0
    for e in entries:
        value = e.get("value") if isinstance(e, dict) else None
        number = e.get("number") if isinstance(e, dict) else None
        if (isinstance(number, int) and not isinstance(number, bool) and isinstance(value, (int, float))
                and not isinstance(value, bool) and math.isfinite(value)):
            entry = {**e, "value": float(value)}
            if not isinstance(entry.get("epoch", 0), int) or isinstance(entry.get("epoch"), bool):
                entry.pop("epoch")  # (not needed to rank; shown when it is a number)
            good.append(entry)
        else:
            bad += 1
    return good, (f"{path!r} is damaged ({bad} of {len(entries)} entries lack a number or a finite value)"
                  if bad else None)


def epoch_end_value(prefix: str, monitor: str) -> Optional[Tuple[float, int]]:
    """``(value of monitor, epoch)`` recorded in checkpoint ``prefix`` when it is an epoch-end checkpoint (its
    position is the start of the epoch after the one its logs are of); ``None`` otherwise, or when the value is
    missing or not finite. Raises when the checkpoint cannot be read.

    Example:
        epoch_end_value("ckpt/ckpt-30", "val_loss")   # (0.031, 2)
    """
    reader = read_checkpoint(prefix)
    if not reader.has_tensor(_EPOCH_LOGS_KEY):
        return None
    raw = reader.get_tensor(_EPOCH_LOGS_KEY)
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    if not text:
        return None
    record = json.loads(text)
    position = {}
    for name in _POSITION:
        key = f"keras_scale_position/{name}/.ATTRIBUTES/VARIABLE_VALUE"
        position[name] = int(reader.get_tensor(key)) if reader.has_tensor(key) else 0
    epoch = record.get("epoch") if isinstance(record, dict) else None
    value = (record.get("logs") or {}).get(monitor) if isinstance(record, dict) else None
    if (not isinstance(epoch, int) or position["step_in_epoch"] != 0 or position["epoch"] != epoch + 1
            or not isinstance(value, (int, float)) or not math.isfinite(value)):
        return None
    return float(value), epoch


def _numbers_in(directory: str) -> Dict[int, str]:
    """``{number: prefix}`` of the checkpoints in ``directory`` whose files all live in it (no link out)."""
    from keras_scale.callbacks.checkpoint.directory import _files_inside

    try:
        names = tf.io.gfile.listdir(directory)
    except (tf.errors.OpError, OSError):
        return {}
    out = {}
    for name in names:
        m = _INDEX_RE.match(name.rstrip("/"))
        if m:
            prefix = os.path.join(directory, name.rstrip("/")[: -len(".index")])
            if _files_inside(directory, prefix):
                out[int(m.group(1))] = prefix
    return out


def new_run_start(best_dir: str) -> int:
    """The step the newest run in the directory was numbered after, as ``best/earlier-run-to-ckpt-<step>/`` (set
    aside when it started) records it; ``-1`` when no run set an earlier one's best checkpoints aside. Checkpoints
    numbered up to it are an earlier run's: ``keep_best_k`` never ranks them.

    Example:
        new_run_start("ckpt/best")   # 48
    """
    try:
        names = tf.io.gfile.listdir(best_dir)
    except (tf.errors.OpError, OSError):
        return -1
    steps = [int(n.rstrip("/")[len(EARLIER_RUN_PREFIX):]) for n in names
             if n.startswith(EARLIER_RUN_PREFIX) and n.rstrip("/")[len(EARLIER_RUN_PREFIX):].isdigit()]
    return max(steps, default=-1)


def ranked_in_best(best_dir: str) -> Tuple[Optional[List[Dict[str, Any]]], Dict[int, str], List[str]]:
    """``(entries, in_best, problems)``: ``best.json``'s valid entries whose checkpoint's files are complete in
    ``best_dir`` (``None`` when there is no ``best.json``), ``{number: prefix}`` of those complete checkpoints, and
    the problems found (a damaged file; entries whose files are missing, left out). What ``fit`` ranks from and what
    ``keras-scale checkpoint ls`` shows.

    Example:
        ranked_in_best("ckpt/best")[0]   # [{'number': 30, 'value': 0.031, 'epoch': 2, 'monitor': 'val_loss'}]
    """
    entries, problem = read_best_json(best_dir)
    problems = [problem] if problem else []
    in_best = {n: p for n, p in _numbers_in(best_dir).items() if is_complete(p)}
    seen, kept = set(), []
    for e in entries or []:
        if e["number"] in seen:
            continue
        seen.add(e["number"])
        if e["number"] in in_best:
            kept.append(e)
        else:
            problems.append(f"{os.path.join(best_dir, BEST_JSON)!r} lists {_NAME}-{e['number']}, whose files are not "
                            "in best/ (dropped from the ranking)")
    return (None if entries is None else kept), in_best, problems


def reconcile_best(directory: str, monitor: str, mode: str, keep_best_k: int,
                   candidates: List[Tuple[int, str]]) -> Dict[str, Any]:
    """The best-k ranking of ``directory`` rebuilt from what is on disk; reads only.

    ``best.json``'s valid entries whose files are in ``best/``, every checkpoint in ``best/`` that it does not rank
    (its value read from its own epoch logs), and every epoch-end checkpoint of ``candidates`` (the directory's
    committed checkpoints) that no entry ranks, best first, the ``keep_best_k`` best kept. Returns ``best`` (the
    entries), ``link`` (``{number: prefix}``: checkpoints of the directory to link into ``best/``), ``drop``
    (numbers in ``best/`` ranked out), ``unranked`` (prefixes in ``best/`` whose value cannot be read: kept) and
    ``problems``.

    Example:
        reconcile_best("ckpt", "val_loss", "min", 2, list_checkpoints("ckpt"))["best"]
    """
    best_dir = os.path.join(directory, _BEST_DIR)
    entries, _ = read_best_json(best_dir)
    listed, in_best, problems = ranked_in_best(best_dir)
    damaged = bool(problems)
    ranked: Dict[int, Dict[str, Any]] = {}
    reranked: List[str] = []
    unmonitored: List[int] = []  # ranked by another monitor, which records no value of this one: dropped
    for e in listed or []:
        was = e.get("monitor", monitor)
        if was == monitor:
            ranked[e["number"]] = e
            continue
        try:  # monitor changed since it was ranked: ranked again by the value of this monitor its epoch recorded
            found = epoch_end_value(in_best[e["number"]], monitor)
        except Exception:  # noqa: BLE001 - unreadable: it cannot be ranked by this monitor
            found = None
        if found is None:
            unmonitored.append(e["number"])
        else:
            ranked[e["number"]] = {"number": e["number"], "value": found[0], "epoch": found[1], "monitor": monitor}
            reranked.append(f"{_NAME}-{e['number']} ({was}={e['value']:.6g} -> {monitor}={found[0]:.6g})")
    if reranked:
        problems.append(f"{os.path.join(best_dir, BEST_JSON)!r} ranks by another monitor than {monitor!r}: "
                        f"{', '.join(reranked)} ranked again by the {monitor!r} of its epoch, as each checkpoint "
                        "records it")
    if unmonitored:
        problems.append(f"{', '.join(f'{_NAME}-{n}' for n in unmonitored)} in best/ "
                        f"{'was' if len(unmonitored) == 1 else 'were'} ranked by another monitor and "
                        f"{'records' if len(unmonitored) == 1 else 'record'} no {monitor!r} of an epoch end: "
                        "removed from best/ (monitor changed)")
    unranked: List[str] = []
    rebuilt: List[int] = []
    for number, prefix in sorted(in_best.items()):
        if number in ranked or number in unmonitored:
            continue
        try:
            found = epoch_end_value(prefix, monitor)
            why = f"records no finite {monitor!r} of an epoch end"
        except Exception as e:  # noqa: BLE001 - damaged: kept, never deleted
            found, why = None, f"cannot be read ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]})"
        if found is None:
            problems.append(f"{prefix!r} is in best/ but {why}: kept (never deleted), not ranked; move it away "
                            "if it is not wanted")
            unranked.append(prefix)
            continue
        ranked[number] = {"number": number, "value": found[0], "epoch": found[1], "monitor": monitor}
        rebuilt.append(number)
    if rebuilt:
        problems.append(f"{', '.join(f'{_NAME}-{n}' for n in rebuilt)} in best/ {'was' if len(rebuilt) == 1 else 'were'} "
                        f"not ranked in {BEST_JSON} (a kill before it was written, or a damaged file): ranked by the "
                        "value each checkpoint records")
    link: Dict[int, str] = {}
    run_start = new_run_start(best_dir)
    for number, prefix in sorted(candidates):
        if number in ranked or number in in_best or number <= run_start:  # (an earlier run's: never ranked)
            continue
        try:
            found = epoch_end_value(prefix, monitor)
        except Exception:  # noqa: BLE001 - a damaged checkpoint of the directory ranks nothing (resume reports it)
            found = None
        if found is not None:
            ranked[number] = {"number": number, "value": found[0], "epoch": found[1], "monitor": monitor}
            link[number] = prefix
    order = sorted(ranked.values(), key=lambda e: e["number"])
    order.sort(key=lambda e: e["value"], reverse=mode == "max")
    keep, out = order[:keep_best_k], order[keep_best_k:]
    kept_numbers = {e["number"] for e in keep}
    link = {n: p for n, p in link.items() if n in kept_numbers}
    if link:
        problems.append(f"the epoch-end {', '.join(f'{_NAME}-{n}' for n in sorted(link))} {'ranks' if len(link) == 1 else 'rank'} "
                        f"among the {keep_best_k} best by {monitor!r} but {'is' if len(link) == 1 else 'are'} not in "
                        "best/ (a kill between its save and keep_best_k's copy): kept there now")
    drop = [e["number"] for e in out if e["number"] in in_best]
    drop_unmonitored = unmonitored
    if drop:  # keep_best_k lowered, mode changed, or a kill after a better one was kept: said, never silent
        problems.append(f"{', '.join(f'{_NAME}-{n}' for n in drop)} in best/ {'ranks' if len(drop) == 1 else 'rank'} "
                        f"below the {keep_best_k} best by {monitor!r} ({mode}): removed from best/")
    return {"best": keep, "link": link, "drop": drop + drop_unmonitored,
            "unranked": unranked, "problems": problems, "changed": damaged or (entries or []) != keep}


def link_into(src_prefix: str, best_dir: str) -> None:
    """Hard-link (or copy, across file systems and on object stores) checkpoint ``src_prefix``'s files into
    ``best_dir``; a link already at a destination name is removed, never written through."""
    directory, src_name = os.path.split(src_prefix)
    names = [n.rstrip("/") for n in tf.io.gfile.listdir(directory)]
    # the data first, the index last: an index in best/ means its data is there (a kill in between leaves data
    # without an index, an orphan)
    for name in sorted(names, key=lambda n: n.endswith(".index")):
        if name == src_name + ".index" or name.startswith(src_name + ".data-"):
            src, dst = os.path.join(directory, name), os.path.join(best_dir, name)
            try:
                if not _is_local(src):
                    raise OSError
                remove_entry(dst)  # (a link there is removed, never written through)
                os.link(src, dst)
            except OSError:
                remove_entry(dst)
                tf.io.gfile.copy(src, dst, overwrite=True)


def _remove_number(best_dir: str, number: int) -> None:
    for name in tf.io.gfile.listdir(best_dir):
        if name.startswith(f"{_NAME}-{number}.index") or name.startswith(f"{_NAME}-{number}.data-"):
            remove_entry(os.path.join(best_dir, name))


class BestMixin:
    """Part of :class:`ChiefCheckpoint` (a mixin: it uses the callback's own state)."""

    def _consider_best(self, epoch: int, logs: Any) -> None:
        if not self.keep_best_k:
            return
        value = (logs or {}).get(self.monitor)
        if value is None:
            if not self._warned_monitor:
                self._warned_monitor = True
                warnings.warn(f"ChiefCheckpoint: keep_best_k needs {self.monitor!r} in the epoch logs, which hold "
                              f"{sorted(logs or {})}; no best checkpoint kept for this epoch.", RuntimeWarning,
                              stacklevel=3)
            return
        value = float(value)
        if math.isnan(value):
            return
        best = self._best
        if len(best) >= self.keep_best_k and not self._better(value, best[-1]["value"]):
            return
        self._pending_best = (value, epoch)
        self._pending_epoch_save = True  # the epoch-end state is saved (at the next step or at train end)

    def _better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b

    def _best_dir(self) -> str:
        return os.path.join(self.directory, _BEST_DIR)

    def _reconcile_best(self) -> Dict[str, Any]:
        from keras_scale.callbacks.checkpoint.directory import list_checkpoints

        return reconcile_best(self.directory, self.monitor, self.mode, max(int(self.keep_best_k), 1),
                              list_checkpoints(self.directory))

    def _read_best(self) -> List[Dict[str, Any]]:
        """The kept best entries, best first, as the files on disk rank them (reads only)."""
        if not self.keep_best_k and not tf.io.gfile.isdir(self._best_dir()):
            return []
        return self._reconcile_best()["best"] if self.keep_best_k else (read_best_json(self._best_dir())[0] or [])

    def _repair_best(self) -> None:
        """Chief, at ``fit`` start: make ``best/`` and ``best.json`` what the checkpoints rank (see
        :func:`reconcile_best`): link the epoch-end checkpoints a kill kept out, remove the ranked-out ones, rewrite
        a missing, damaged or stale ``best.json``, warn naming what was found. Unrankable files are kept."""
        best_dir = self._best_dir()
        if not self.keep_best_k or not tf.io.gfile.isdir(self.directory) or (
                _is_local(best_dir) and os.path.islink(best_dir)):
            return
        plan = self._reconcile_best()
        if plan["problems"]:
            warnings.warn("ChiefCheckpoint: keep_best_k: " + "; ".join(plan["problems"]) + ".", RuntimeWarning,
                          stacklevel=3)
        try:
            if plan["link"]:
                tf.io.gfile.makedirs(best_dir)
                for prefix in plan["link"].values():
                    link_into(prefix, best_dir)
            if plan["changed"] and (plan["best"] or tf.io.gfile.exists(os.path.join(best_dir, BEST_JSON))):
                write_atomic(os.path.join(best_dir, BEST_JSON), json.dumps(plan["best"]))
            for number in plan["drop"]:
                _remove_number(best_dir, number)
        except (OSError, tf.errors.OpError) as e:  # e.g. best/ or best.json is not what it should be
            warnings.warn(f"ChiefCheckpoint: keep_best_k could not bring {best_dir!r} up to date ({e}); training "
                          "goes on, the best checkpoints are ranked again at the next start.", RuntimeWarning,
                          stacklevel=3)

    def _set_best_aside(self, after_step: int, why: str) -> None:
        """Chief, at the start of a new run (``restore=False``, ``on_completed="restart"``): move the earlier run's
        ``best/`` checkpoints and ``best.json`` into ``best/earlier-run-to-ckpt-<after_step>/`` (nothing deleted;
        hard links where possible), so ``keep_best_k`` ranks the new run only and no later start ranks them again."""
        self._best = []
        best_dir = self._best_dir()
        if not self._chief or not tf.io.gfile.isdir(best_dir) or (_is_local(best_dir) and os.path.islink(best_dir)):
            return
        numbers = sorted(_numbers_in(best_dir))
        has_json = tf.io.gfile.exists(os.path.join(best_dir, BEST_JSON))
        if not numbers and not has_json:
            return
        aside = os.path.join(best_dir, f"{EARLIER_RUN_PREFIX}{after_step}")
        try:
            tf.io.gfile.makedirs(aside)
            # copied (linked) in full first, then removed from best/: a kill in between loses nothing
            for number in numbers:
                link_into(os.path.join(best_dir, f"{_NAME}-{number}"), aside)
            if has_json:
                tf.io.gfile.copy(os.path.join(best_dir, BEST_JSON), os.path.join(aside, BEST_JSON), overwrite=True)
                remove_entry(os.path.join(best_dir, BEST_JSON))
            for number in numbers:
                _remove_number(best_dir, number)
        except (OSError, tf.errors.OpError) as e:
            warnings.warn(f"ChiefCheckpoint: could not move the earlier run's best checkpoints in {best_dir!r} "
                          f"aside to {aside!r} ({type(e).__name__}: {e}); move them away by hand, or the next start "
                          "ranks them with this run's.", RuntimeWarning, stacklevel=3)
            return
        names = ", ".join(f"{_NAME}-{n}" for n in numbers) or BEST_JSON
        warnings.warn(f"ChiefCheckpoint: {why} starts a new run: the earlier run's best checkpoints in best/ "
                      f"({names}) are moved aside to {aside!r} (kept, never ranked again); keep_best_k ranks the new "
                      "run only.", RuntimeWarning, stacklevel=3)

    def _keep_best(self, value: float, epoch: int) -> None:
        """Copy (hard-link where possible) the checkpoint just saved for this epoch's end into ``best/``."""
        if self._last_saved_prefix is None:
            return
        number = self._last_saved_step
        entries = [e for e in self._best if e["number"] != number]
        entries.append({"number": number, "value": value, "epoch": epoch, "monitor": self.monitor})
        entries.sort(key=lambda e: e["value"], reverse=self.mode == "max")
        self._best, drop = entries[: self.keep_best_k], entries[self.keep_best_k:]
        if not self._chief:  # every worker keeps the same list; only the chief writes files
            return
        self._wait()  # the files must be complete before they are linked
        best_dir = self._best_dir()
        if os.path.islink(best_dir):  # never follow a link out of the directory
            warnings.warn(f"ChiefCheckpoint: {best_dir!r} is a symbolic link; keep_best_k does not write through it. "
                          "Remove the link.", RuntimeWarning, stacklevel=2)
            return
        src_name = os.path.basename(self._last_saved_prefix)
        try:
            tf.io.gfile.makedirs(best_dir)
            link_into(self._last_saved_prefix, best_dir)
            # the ranking first, then the ranked-out files: a kill in between leaves files best.json does not list,
            # which the next start ranks from their own logs (never a listed entry without its files)
            write_atomic(os.path.join(best_dir, BEST_JSON), json.dumps(self._best))
            for e in drop:
                _remove_number(best_dir, e["number"])
        except (OSError, tf.errors.OpError) as e:  # the checkpoint itself is saved: training goes on
            warnings.warn(f"ChiefCheckpoint: keep_best_k could not keep {self._last_saved_prefix!r} in {best_dir!r} "
                          f"({type(e).__name__}: {e}); the checkpoint itself is saved and training goes on. Fix "
                          f"{best_dir!r} (it must be a directory this process can write; best.json a file); the next "
                          "start ranks the best checkpoints again.", RuntimeWarning, stacklevel=2)
            return
        self._say(f"ChiefCheckpoint: {self.monitor}={value:.6g} at epoch {epoch + 1}: kept as "
                  f"{os.path.join(best_dir, src_name)!r}")
