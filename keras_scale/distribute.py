"""Who am I in the cluster, which strategy to use, and the small Keras multi-worker fix.

- Chief-only behaviour (who writes files, who prints) is decided here, in :func:`is_chief`, and nowhere else.
- :func:`choose_strategy`: ``TF_CONFIG`` or a Slurm step -> ``MultiWorkerMirroredStrategy``, several GPUs ->
  ``MirroredStrategy`` (with an all-reduce that passed a probe), else the default strategy.
- :func:`patch_keras_multi_worker`: makes Keras 3's ``model.fit`` work under ``MultiWorkerMirroredStrategy``
  (keras-team/keras#20585), guarded by :func:`keras_internals_report`.

Example:
    >>> from keras_scale.distribute import choose_strategy, is_chief
    >>> strategy = choose_strategy()          # first thing in the script: before any TensorFlow op
    >>> if is_chief(strategy):
    ...     print("I write the checkpoints")
    I write the checkpoints
"""
from __future__ import annotations

import json
import logging
import os
import warnings
from typing import Any, Mapping, Optional, Sequence, Tuple, Union


def tf_config(environ: Optional[Mapping[str, str]] = None) -> Optional[dict]:
    """The parsed ``TF_CONFIG`` environment variable (of ``environ``, default ``os.environ``), or ``None`` when
    unset or empty; a ``ValueError`` naming the fix when it is not JSON.

    Example:
        >>> tf_config({"TF_CONFIG": '{"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 0}}'})
        {'cluster': {'worker': ['h:1']}, 'task': {'type': 'worker', 'index': 0}}
    """
    raw = (os.environ if environ is None else environ).get("TF_CONFIG", "").strip()
    if not raw:
        return None
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"TF_CONFIG is not valid JSON ({e}): {raw[:200]!r}. Fix the variable or unset it.") from e
    return config or None


#: Where a multi-worker cluster can come from, in the order they are read (strategy choice, chief detection and
#: ``keras-scale doctor`` all read this one list through :func:`cluster_task` / :func:`cluster_tf_config`).
CLUSTER_SOURCES = ("TF_CONFIG", "Slurm", "Kubernetes")


def _slurm_task(env: Mapping[str, str]) -> Optional[Tuple[int, int]]:
    try:
        num_tasks = int(env.get("SLURM_STEP_NUM_TASKS", "0") or 0)
        index = int(env.get("SLURM_PROCID", "-1"))
    except ValueError:
        return None
    return (index, num_tasks) if "SLURM_PROCID" in env and num_tasks > 1 and 0 <= index < num_tasks else None


def _kubernetes_task(env: Mapping[str, str]) -> Optional[Tuple[int, int]]:
    try:
        num_workers = int(env.get("KERAS_SCALE_NUM_WORKERS", "0") or 0)
        index = int(env.get("JOB_COMPLETION_INDEX", "-1"))
    except ValueError:
        return None
    return (index, num_workers) if num_workers > 1 and 0 <= index < num_workers else None


def kubernetes_tf_config(environ: Optional[Mapping[str, str]] = None) -> Optional[dict]:
    """The ``TF_CONFIG`` dict of this pod of a Kubernetes Indexed Job, or ``None`` outside one.

    Reads ``JOB_COMPLETION_INDEX`` (set by Kubernetes for Indexed Jobs), ``KERAS_SCALE_NUM_WORKERS`` (the Job's
    ``completions``), the pod's ``HOSTNAME`` (``<job>-<index>`` for Indexed Job pods),
    ``KERAS_SCALE_K8S_SUBDOMAIN`` (the headless Service the pods' ``subdomain`` names) and
    ``KERAS_SCALE_PORT_BASE`` (default 8888). Worker ``i`` is ``<job>-<i>.<subdomain>:<port>``;
    ``KERAS_SCALE_WORKER_ADDRESS`` overrides that pattern (fields ``{job}``, ``{index}``, ``{subdomain}``, ``{port}``
    and ``{index_port}`` = port + index, e.g. ``127.0.0.1:{index_port}`` for loopback tests).

    Example:
        >>> kubernetes_tf_config({"JOB_COMPLETION_INDEX": "1", "KERAS_SCALE_NUM_WORKERS": "2",
        ...                       "HOSTNAME": "train-1", "KERAS_SCALE_K8S_SUBDOMAIN": "train"})
        {'cluster': {'worker': ['train-0.train:8888', 'train-1.train:8888']}, 'task': {'type': 'worker', 'index': 1}}
    """
    env = os.environ if environ is None else environ
    task = _kubernetes_task(env)
    if task is None:
        return None
    index, num_workers = task
    hostname = env.get("HOSTNAME", "")
    suffix = f"-{index}"
    job = hostname[:-len(suffix)] if hostname.endswith(suffix) else env.get("KERAS_SCALE_K8S_JOB", hostname)
    subdomain = env.get("KERAS_SCALE_K8S_SUBDOMAIN", "")
    port = int(env.get("KERAS_SCALE_PORT_BASE", "8888"))
    pattern = env.get("KERAS_SCALE_WORKER_ADDRESS") or ("{job}-{index}.{subdomain}:{port}" if subdomain
                                                         else "{job}-{index}:{port}")
    workers = [pattern.format(job=job, index=i, subdomain=subdomain, port=port, index_port=port + i)
               for i in range(num_workers)]
    return {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}


def cluster_task(environ: Optional[Mapping[str, str]] = None) -> Tuple[Optional[str], Optional[str], int, int]:
    """``(source, task_type, task_index, num_workers)`` from the first of :data:`CLUSTER_SOURCES` that names a
    multi-worker cluster; ``(None, None, 0, 1)`` when none does. TensorFlow-free (``is_chief`` and the doctor use it
    before any strategy exists).

    Example:
        >>> cluster_task({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"})
        ('Slurm', 'worker', 1, 2)
        >>> cluster_task({})
        (None, None, 0, 1)
    """
    env = os.environ if environ is None else environ
    config = tf_config(env)
    if config and config.get("cluster"):
        task = config.get("task") or {}
        n = sum(len(v) for k, v in config["cluster"].items() if k in ("chief", "worker") and isinstance(v, list))
        return "TF_CONFIG", task.get("type"), int(task.get("index", 0) or 0), max(n, 1)
    slurm = _slurm_task(env)
    if slurm is not None:
        return "Slurm", "worker", slurm[0], slurm[1]
    kubernetes = _kubernetes_task(env)
    if kubernetes is not None:
        return "Kubernetes", "worker", kubernetes[0], kubernetes[1]
    return None, None, 0, 1


def cluster_tf_config(environ: Optional[Mapping[str, str]] = None) -> Optional[Tuple[str, dict]]:
    """``(source, TF_CONFIG dict)`` of the first of :data:`CLUSTER_SOURCES` that names a cluster, else ``None``
    (Slurm's host list is expanded by TensorFlow's ``SlurmClusterResolver``).

    Example:
        >>> cluster_tf_config({"JOB_COMPLETION_INDEX": "0", "KERAS_SCALE_NUM_WORKERS": "2", "HOSTNAME": "t-0"})[0]
        'Kubernetes'
    """
    env = os.environ if environ is None else environ
    source = cluster_task(env)[0]
    if source == "TF_CONFIG":
        return source, tf_config(env)
    if source == "Slurm":
        return source, slurm_tf_config(dict(env))
    if source == "Kubernetes":
        return source, kubernetes_tf_config(env)
    return None


def task_identity(strategy: Any = None) -> Tuple[Optional[str], int]:
    """``(task_type, task_id)`` of this process; ``(None, 0)`` outside a multi-worker cluster.

    Uses the strategy's cluster resolver when given, else the cluster sources (:data:`CLUSTER_SOURCES`:
    ``TF_CONFIG``, a Slurm step, a Kubernetes Indexed Job), so it is right before a strategy is built.

    Example:
        >>> task_identity()
        (None, 0)
    """
    resolver = getattr(strategy, "cluster_resolver", None) if strategy is not None else None
    if resolver is not None and getattr(resolver, "task_type", None):
        return resolver.task_type, int(resolver.task_id or 0)
    source, task_type, index, _ = cluster_task()
    if source is None or task_type is None:
        return None, 0
    return task_type, index


def _has_chief_task(strategy: Any = None) -> bool:
    resolver = getattr(strategy, "cluster_resolver", None) if strategy is not None else None
    if resolver is not None:
        try:
            return "chief" in resolver.cluster_spec().as_dict()
        except Exception:  # noqa: BLE001 - resolver without a spec
            pass
    config = tf_config() or {}
    return "chief" in config.get("cluster", {})


def is_chief(strategy: Any = None) -> bool:
    """True in the one process that writes files and prints summaries.

    Single process and ``MirroredStrategy``: always True. Multi-worker: the ``chief`` task, or ``worker`` 0
    when the cluster has no ``chief`` (TensorFlow's convention).

    Example:
        >>> is_chief()
        True
    """
    task_type, task_id = task_identity(strategy)
    if task_type is None:
        return True
    if task_type == "chief":
        return True
    return task_type == "worker" and task_id == 0 and not _has_chief_task(strategy)


# --------------------------------------------------------------------------------------------------------------
# The small Keras multi-worker fix (keras-team/keras#20585)
# --------------------------------------------------------------------------------------------------------------
# Keras 3's TensorFlow trainer crashes under MultiWorkerMirroredStrategy in two places:
#   1. ``TensorFlowTrainer._maybe_symbolic_build`` calls ``strategy.reduce("MEAN", data_batch, axis=None)`` on a
#      PerReplica *data batch* ("Attempt to convert a value (PerReplica...)"). Only the batch's shapes matter
#      there, so one local replica's value does the same job.
#   2. ``reduce_per_replica`` (module function) calls ``strategy.reduce("MEAN", v, axis=0)`` on scalar metric
#      results in its multi-worker branch ("Invalid reduction dimension 0"). ``axis=None`` (mean across replicas,
#      element-wise) is what the single-worker branch computes too.
# The patch wraps both and changes only the multi-worker case; everything else is delegated to the originals.

_KERAS_PATCH_MIN = (3, 0)  # the trainer layout these fingerprints were read from exists since Keras 3.0
_KERAS_PATCH_TESTED_MAX = (3, 15)  # newest minor version the fix was verified on (2-process equivalence test)

# What the patch expects to find in the original Keras sources; `keras_internals_report()` checks them.
_FINGERPRINTS = {
    "reduce_per_replica": 'strategy.reduce("MEAN", v, axis=0)',
    "_maybe_symbolic_build": "self.distribute_strategy.reduce(",
}

_patch_state: dict = {"applied": False, "reason": "not attempted"}


def _keras_version() -> Tuple[int, int]:
    import keras

    major, minor = (keras.__version__.split(".") + ["0"])[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def keras_internals_report() -> dict:
    """What :func:`patch_keras_multi_worker` needs from Keras, and whether this Keras still has it.

    Returns a dict ``{"keras_version", "backend", "missing": [...], "changed": [...]}``: ``missing`` names
    internals that no longer exist, ``changed`` names functions whose source no longer contains the crashing call
    (a newer Keras may have fixed it). Both empty means the patch applies as written.

    Example:
        >>> keras_internals_report()["missing"]
        []
    """
    import inspect

    import keras

    report = {"keras_version": keras.__version__, "backend": keras.backend.backend(), "missing": [], "changed": []}
    try:
        from keras.src.backend.tensorflow import trainer as tf_trainer
    except ImportError:
        report["missing"].append("keras.src.backend.tensorflow.trainer")
        return report
    targets = {
        "reduce_per_replica": getattr(tf_trainer, "reduce_per_replica", None),
        "_maybe_symbolic_build": getattr(tf_trainer.TensorFlowTrainer, "_maybe_symbolic_build", None),
    }
    for helper in ("_collective_all_reduce_multi_worker", "_is_per_replica_instance"):
        if not callable(getattr(tf_trainer, helper, None)):
            report["missing"].append(helper)
    for name, fn in targets.items():
        fn = getattr(fn, "__wrapped__", fn)  # look through our own wrapper
        if fn is None:
            report["missing"].append(name)
            continue
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):
            report["missing"].append(f"{name} (source)")
            continue
        if _FINGERPRINTS[name] not in source:
            report["changed"].append(name)
    return report


def _patch_refusal(report: dict, version: Tuple[int, int]) -> Optional[Tuple[str, bool]]:
    """Why :func:`patch_keras_multi_worker` must not patch this Keras: ``(reason, warn_loudly)``, or None."""
    if report["backend"] != "tensorflow":
        return f"Keras backend is {report['backend']!r}, the fix is for the TensorFlow backend", False
    if version < _KERAS_PATCH_MIN:
        return f"Keras {report['keras_version']} predates the Keras 3 trainer this fix targets", False
    if report["missing"]:
        return (f"Keras {report['keras_version']} no longer has {report['missing']}; multi-worker fit is NOT "
                "patched. Check keras-team/keras#20585 and update keras_scale."), True
    if report["changed"]:
        return (f"Keras {report['keras_version']} changed {report['changed']} (the crashing calls are gone); "
                "not patching. If multi-worker fit still fails, update keras_scale."), True
    if version > _KERAS_PATCH_TESTED_MAX:
        logging.getLogger("keras_scale").info(
            "Keras %s is newer than the newest version the multi-worker fix was tested on (%d.%d); applying it "
            "because the patched internals are unchanged.", report["keras_version"], *_KERAS_PATCH_TESTED_MAX)
    return None


def patch_keras_multi_worker() -> bool:
    """Make Keras's own ``model.fit`` / ``evaluate`` work under ``MultiWorkerMirroredStrategy`` (idempotent).

    Fixes the two crashes of keras-team/keras#20585 in the TensorFlow trainer: the symbolic build uses one local
    replica's data batch instead of reducing it (multi-worker, and MirroredStrategy whose first validation batch
    does not split evenly over the replicas), and multi-worker metric results are averaged across replicas with
    ``axis=None`` instead of ``axis=0``. Single-device behaviour is unchanged.

    Guarded: it patches only the TensorFlow backend of Keras >= 3.0 whose sources still contain the crashing calls
    (see :func:`keras_internals_report`); on a newer Keras that no longer has them it does nothing and says why.
    :func:`keras_scale.fit` calls it for you.

    Returns:
        True when the fix is in place (now or from an earlier call), False when it was not applied.

    Example:
        >>> import keras_scale.distribute as ksd
        >>> ksd.patch_keras_multi_worker()
        True

        Then, in each worker's script::

            strategy = tf.distribute.MultiWorkerMirroredStrategy()
            with strategy.scope():
                model = build_and_compile()
            model.fit(ds)
    """
    import functools

    if _patch_state["applied"]:
        return True
    refusal = _patch_refusal(keras_internals_report(), _keras_version())
    if refusal is not None:
        _patch_state["reason"], loud = refusal
        if loud:
            warnings.warn(_patch_state["reason"], RuntimeWarning, stacklevel=2)
        return False

    import tensorflow as tf
    from keras.src.backend.tensorflow import trainer as tf_trainer
    from keras.src import tree

    original_reduce = tf_trainer.reduce_per_replica
    original_build = tf_trainer.TensorFlowTrainer._maybe_symbolic_build
    keras_is_multi_worker = tf_trainer._collective_all_reduce_multi_worker

    @functools.wraps(original_reduce)
    def reduce_per_replica(values, strategy, reduction):
        if reduction in ("auto", "mean") and keras_is_multi_worker(strategy):
            return tree.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), values)
        return original_reduce(values, strategy, reduction)

    @functools.wraps(original_build)
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # multi-worker: reducing a PerReplica batch crashes (#20585); MirroredStrategy: it crashes when the first
        # (validation) batch does not split evenly over the replicas (AddN shape mismatch). Only shapes matter here.
        strategy = self._distribute_strategy
        if strategy is None or iterator is None or strategy.num_replicas_in_sync < 2:
            return original_build(self, iterator=iterator, data_batch=data_batch)
        for _, _, it in iterator:
            batch = next(it)
            data_batch = tree.map_structure(
                lambda x: (strategy.experimental_local_results(x)[0]
                           if isinstance(x, tf.distribute.DistributedValues) else x),
                batch,
            )
            break
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    tf_trainer.reduce_per_replica = reduce_per_replica
    tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
    import keras

    _patch_state.update(applied=True, reason=f"patched Keras {keras.__version__} (keras-team/keras#20585)")
    logging.getLogger("keras_scale").debug(_patch_state["reason"])
    return True


def require_keras_multi_worker_fix(strategy: Any) -> None:
    """Apply :func:`patch_keras_multi_worker` for a multi-worker ``strategy``; raise with the reason if it cannot.

    Without the fix Keras's ``fit`` crashes under ``MultiWorkerMirroredStrategy`` (keras-team/keras#20585), so
    failing here, at fit start, with why, beats a crash deep in Keras.

    Example:
        >>> import tensorflow as tf
        >>> require_keras_multi_worker_fix(tf.distribute.get_strategy())   # single process: nothing to do
    """
    if not is_multi_worker(strategy):
        patch_keras_multi_worker()  # also fixes MirroredStrategy's uneven first validation batch
        return
    if not patch_keras_multi_worker():
        raise RuntimeError(
            f"keras_scale cannot train under MultiWorkerMirroredStrategy with this Keras: the fix for "
            f"keras-team/keras#20585 is not in place ({_patch_state['reason']}). Use a Keras version keras_scale "
            f"supports (see `keras-scale doctor`), or update keras_scale.")


def is_multi_worker(strategy: Any) -> bool:
    """True for a strategy that spans several processes (``MultiWorkerMirroredStrategy`` with a cluster).

    The one place keras_scale decides "is this multi-worker?" (step, checkpoint, fit and the Keras fix ask here).

    Example:
        >>> import tensorflow as tf
        >>> is_multi_worker(tf.distribute.get_strategy())
        False
    """
    in_multi_worker_mode = getattr(getattr(strategy, "extended", None), "_in_multi_worker_mode", None)
    return bool(in_multi_worker_mode is not None and in_multi_worker_mode())


def chief_print(message: str, strategy: Any = None, verbose: int = 1, incident: bool = False) -> None:
    """Print ``message`` once per job: in the chief only, and only when ``verbose``.

    Printed by :func:`keras_scale.output.say`, the pack's one printer: routine messages through Keras's
    ``io_utils.print_msg`` (stdout, or absl logging when Keras's interactive logging is off); an ``incident`` (a
    skipped NaN step, a fallback) to stderr.

    Example:
        >>> chief_print("checkpoint saved", verbose=1)
        checkpoint saved
    """
    if not verbose or not is_chief(strategy):
        return
    from keras_scale.output import say

    say(message, incident=incident)


# --------------------------------------------------------------------------------------------------------------
# Strategy selection
# --------------------------------------------------------------------------------------------------------------

#: names accepted by :func:`choose_strategy` besides ``"auto"``
STRATEGY_NAMES = ("default", "mirrored", "multi_worker")
#: ``all_reduce`` values accepted by :func:`choose_strategy`
ALL_REDUCE_CHOICES = ("auto", "nccl", "hierarchical_copy", "one_device", "ring")

# A process can configure collectives once: the multi-worker strategy is created once and reused.
_multi_worker_strategy: dict = {}


def slurm_tf_config(environ: Optional[dict] = None, port_base: Optional[int] = None) -> Optional[dict]:
    """The ``TF_CONFIG`` dict of this Slurm task, or ``None`` outside a multi-task Slurm job step.

    Uses ``tf.distribute.cluster_resolver.SlurmClusterResolver`` (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``,
    ``SLURM_STEP_NODELIST``, ``SLURM_STEP_TASKS_PER_NODE``). Ports start at ``port_base`` (default: the
    ``KERAS_SCALE_PORT_BASE`` variable, else 8888) and count up per task on a node. GPUs are left as Slurm bound
    them (``srun --gpus-per-task``); every GPU a task sees becomes one of its replicas.

    Example:
        >>> slurm_tf_config({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2",
        ...                  "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"})
        {'cluster': {'worker': ['node1:8888', 'node2:8888']}, 'task': {'type': 'worker', 'index': 1}}
    """
    env = os.environ if environ is None else environ
    try:
        num_tasks = int(env.get("SLURM_STEP_NUM_TASKS", "0") or 0)
    except ValueError:
        raise ValueError(f"SLURM_STEP_NUM_TASKS is not an integer: {env.get('SLURM_STEP_NUM_TASKS')!r}") from None
    if "SLURM_PROCID" not in env or num_tasks < 2:
        return None
    if port_base is None:
        port_base = int(env.get("KERAS_SCALE_PORT_BASE", "8888"))
    from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver as scr

    saved = {k: os.environ.get(k) for k in env if k.startswith("SLURM_")} if environ is not None else {}
    try:
        if environ is not None:  # the resolver reads os.environ
            os.environ.update({k: v for k, v in env.items() if k.startswith("SLURM_")})
        # gpus_per_node/gpus_per_task only feed the resolver's own GPU bookkeeping, which is switched off here
        resolver = scr.SlurmClusterResolver(port_base=port_base, gpus_per_node=num_tasks, gpus_per_task=1,
                                            auto_set_gpu=False)
        spec = resolver.cluster_spec().as_dict()
        task_type, task_id = resolver.task_type, resolver.task_id
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {"cluster": spec, "task": {"type": task_type, "index": int(task_id)}}


def strategy_plan(strategy: Union[str, Any] = "auto", environ: Optional[dict] = None,
                  num_gpus: Optional[int] = None) -> Tuple[str, str]:
    """Which strategy :func:`choose_strategy` would build, and why: ``(kind, reason)``.

    ``kind`` is ``"multi_worker"``, ``"mirrored"`` or ``"default"``. ``"auto"`` picks multi-worker when one of
    :data:`CLUSTER_SOURCES` names a cluster (``TF_CONFIG``, a Slurm job step with several tasks, a Kubernetes Indexed
    Job), mirrored on several local GPUs, else the default (single-device) strategy.

    Example:
        >>> strategy_plan("auto", environ={}, num_gpus=4)
        ('mirrored', '4 local GPUs')
        >>> strategy_plan("auto", environ={}, num_gpus=0)
        ('default', 'no TF_CONFIG, no multi-task Slurm step, 0 GPUs')
    """
    if not isinstance(strategy, str):
        raise TypeError(
            f"strategy must be 'auto', one of {STRATEGY_NAMES} or a tf.distribute.Strategy, got {strategy!r}"
        )
    if strategy != "auto":
        if strategy not in STRATEGY_NAMES:
            raise ValueError(f"unknown strategy {strategy!r}: use 'auto', one of {STRATEGY_NAMES}, or pass a "
                             "tf.distribute.Strategy object.")
        return strategy, "requested"
    env = os.environ if environ is None else environ
    source, _, _, n = cluster_task(env)
    if source == "TF_CONFIG":
        return "multi_worker", f"TF_CONFIG names a cluster of {n} workers"
    if source == "Slurm":
        return "multi_worker", f"Slurm job step with {n} tasks"
    if source == "Kubernetes":
        return "multi_worker", f"Kubernetes Indexed Job of {n} workers"
    if num_gpus is None:
        import tensorflow as tf

        num_gpus = len(tf.config.list_physical_devices("GPU"))
    if num_gpus > 1:
        return "mirrored", f"{num_gpus} local GPUs"
    return "default", f"no TF_CONFIG, no multi-task Slurm step, {num_gpus} GPU{'s' if num_gpus != 1 else ''}"


def enable_memory_growth() -> int:
    """Let TensorFlow grow GPU memory on demand instead of grabbing it all; returns how many GPUs were set.

    Must run before TensorFlow initialises the GPUs; afterwards it is a no-op (logged).

    Example:
        >>> enable_memory_growth()  # 0 on a CPU-only machine
        0
    """
    import logging

    import tensorflow as tf

    done = 0
    for gpu in tf.config.list_physical_devices("GPU"):
        try:
            if not tf.config.experimental.get_memory_growth(gpu):
                tf.config.experimental.set_memory_growth(gpu, True)
            done += 1
        except RuntimeError as e:  # GPUs already initialised
            logging.getLogger("keras_scale").debug("memory growth not set on %s: %s", gpu.name, e)
    return done


def _cross_device_ops(all_reduce: str):
    import tensorflow as tf

    return {
        "nccl": tf.distribute.NcclAllReduce,
        "hierarchical_copy": tf.distribute.HierarchicalCopyAllReduce,
        "one_device": tf.distribute.ReductionToOneDevice,
        "ring": tf.distribute.ReductionToOneDevice,  # no ring for in-process Mirrored; one_device is the fallback
    }[all_reduce]()


def _probe_all_reduce(strategy) -> None:
    """Run one tiny all-reduce so a broken collective implementation fails here, not mid-training."""
    import tensorflow as tf

    def step():
        return tf.distribute.get_replica_context().all_reduce("SUM", tf.ones([2]))

    # inside a tf.function: an eager strategy.run makes TF log "Using MirroredStrategy eagerly has significant
    # overhead currently" for what is a one-off probe
    result = tf.function(lambda: strategy.run(step))()
    value = strategy.experimental_local_results(result)[0]
    expected = float(strategy.num_replicas_in_sync)
    if float(tf.reduce_sum(value)) != 2 * expected:
        raise RuntimeError(f"all-reduce probe returned {value.numpy().tolist()}, expected [{expected}, {expected}]")


def _require_devices(devices: Optional[Sequence[str]]) -> None:
    """Refuse devices this process does not have (TensorFlow's all-reduce probe would block forever on them)."""
    if not devices:
        return
    import tensorflow as tf

    def key(name: str) -> tuple:
        spec = tf.DeviceSpec.from_string(name)
        return ((spec.device_type or "").upper(), spec.device_index or 0)

    available = tf.config.list_logical_devices()
    have = {key(d.name) for d in available}
    missing = [d for d in devices if key(d) not in have]
    if missing:
        raise ValueError(
            f"devices {missing} do not exist in this process; it has {[d.name for d in available]}. Pass devices "
            f"from that list (or devices=None for all GPUs), or create logical devices first with "
            f"tf.config.set_logical_device_configuration before TensorFlow runs anything.")


def mirrored_with_fallback(devices: Optional[Sequence[str]] = None, candidates: Sequence[Any] = (None, "one_device")):
    """A ``MirroredStrategy`` whose all-reduce works: tries ``candidates`` in order, probing each with one all-reduce.

    A candidate is ``None`` (TensorFlow's default choice, NCCL on GPUs), an ``all_reduce`` name or a
    ``tf.distribute.CrossDeviceOps``. The failure of each rejected candidate is logged as a warning (the seed's
    advice: NCCL failing or slow -> ``ReductionToOneDevice``).

    Example:
        >>> strategy = mirrored_with_fallback(["/cpu:0"])      # on a machine with GPUs: ["/gpu:0", "/gpu:1"]
        >>> strategy.num_replicas_in_sync
        1
    """
    import logging

    import tensorflow as tf

    _require_devices(devices)
    errors = []
    for candidate in candidates:
        ops = _cross_device_ops(candidate) if isinstance(candidate, str) else candidate
        label = candidate if isinstance(candidate, str) else ("TF's default" if ops is None else type(ops).__name__)
        strategy = tf.distribute.MirroredStrategy(devices=devices, cross_device_ops=ops)
        try:
            _probe_all_reduce(strategy)
        except Exception as e:  # noqa: BLE001 - any failure of the collective means: try the next one
            errors.append(f"{label}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            logging.getLogger("keras_scale").warning(
                "all-reduce with %s failed (%s); falling back to the next choice", label, errors[-1])
            continue
        if errors:
            logging.getLogger("keras_scale").warning("using all-reduce %s after: %s", label, "; ".join(errors))
        strategy._keras_scale_all_reduce = label  # noqa: SLF001 - recorded for the fit log
        return strategy
    raise RuntimeError(
        f"no all-reduce implementation worked on devices {devices}: " + " | ".join(errors)
        + ". Try all_reduce='one_device' (ReductionToOneDevice), which needs no NCCL."
    )


def _multi_worker(all_reduce: str, config: Optional[dict]):
    import tensorflow as tf

    key = "strategy"
    if key in _multi_worker_strategy:
        return _multi_worker_strategy[key]
    impl = tf.distribute.experimental.CommunicationImplementation
    implementation = {"auto": impl.AUTO, "nccl": impl.NCCL, "ring": impl.RING,
                      "one_device": impl.RING, "hierarchical_copy": impl.RING}[all_reduce]
    if all_reduce in ("one_device", "hierarchical_copy"):
        import logging

        logging.getLogger("keras_scale").warning(
            "all_reduce=%r does not exist across workers; using RING collectives (the non-NCCL choice)", all_reduce)
    if config is not None:
        os.environ["TF_CONFIG"] = json.dumps(config)  # every later is_chief()/TF_CONFIG reader sees the same cluster
    try:
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=tf.distribute.experimental.CommunicationOptions(implementation=implementation))
    except RuntimeError as e:
        if "program startup" in str(e):
            raise RuntimeError(
                "MultiWorkerMirroredStrategy must be created before TensorFlow runs anything in this process "
                "(building a tf.data.Dataset or a model does). Call `strategy = keras_scale.choose_strategy()` at "
                "the top of the script and pass `strategy=strategy` to keras_scale.fit, or pass NumPy arrays / a "
                f"model builder so fit creates it first. ({e})"
            ) from e
        raise
    strategy._keras_scale_all_reduce = all_reduce  # noqa: SLF001
    _multi_worker_strategy[key] = strategy
    return strategy


def strategy_name(strategy: Any) -> str:
    """The user-facing name of a strategy: its class (``MultiWorkerMirroredStrategy``, not its alias's), or
    ``"default strategy"`` for TensorFlow's default (no ``tf.distribute`` scope, one device).

    Example:
        >>> import tensorflow as tf
        >>> strategy_name(tf.distribute.get_strategy())
        'default strategy'
    """
    import tensorflow as tf

    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return "MultiWorkerMirroredStrategy"
    name = type(strategy).__name__
    return "default strategy" if name.startswith("_DefaultDistributionStrategy") else name


def choose_strategy(strategy: Union[str, Any] = "auto", all_reduce: str = "auto",
                    devices: Optional[Sequence[str]] = None) -> Any:
    """The ``tf.distribute.Strategy`` to train with.

    ``"auto"``: ``TF_CONFIG`` naming a cluster, or a Slurm job step with several tasks (translated to ``TF_CONFIG``
    through ``SlurmClusterResolver``) -> ``MultiWorkerMirroredStrategy``; several local GPUs ->
    ``MirroredStrategy``; else the default strategy. A name (``"default"``, ``"mirrored"``, ``"multi_worker"``) forces
    the kind; a strategy object is returned as is. GPU memory growth is switched on first. The multi-worker strategy
    is created once per process and reused.

    Args:
        strategy: ``"auto"``, a name from :data:`STRATEGY_NAMES`, or a ``tf.distribute.Strategy``.
        all_reduce: ``"auto"`` (TensorFlow's default; for ``MirroredStrategy`` a failing default falls back to
            ``ReductionToOneDevice`` with a warning saying why), ``"nccl"``, ``"hierarchical_copy"``,
            ``"one_device"`` (``ReductionToOneDevice``) or ``"ring"`` (multi-worker RING collectives).
        devices: devices for ``MirroredStrategy`` (default: all local GPUs).

    Example:
        >>> strategy = choose_strategy()                     # at the top of the training script
        >>> type(strategy).__name__                          # doctest: +SKIP
        'MultiWorkerMirroredStrategy'
        >>> choose_strategy("mirrored", all_reduce="one_device", devices=["/cpu:0"]).num_replicas_in_sync
        1
    """
    import logging

    import tensorflow as tf

    if all_reduce not in ALL_REDUCE_CHOICES:
        raise ValueError(f"unknown all_reduce {all_reduce!r}: use one of {ALL_REDUCE_CHOICES}")
    if isinstance(strategy, tf.distribute.Strategy):
        if all_reduce != "auto":
            raise ValueError(
                f"all_reduce={all_reduce!r} cannot change a strategy object you built; pass cross_device_ops / "
                "communication_options when you create it, or pass strategy='auto' or a name instead."
            )
        return strategy
    kind, reason = strategy_plan(strategy)
    enable_memory_growth()
    log = logging.getLogger("keras_scale")
    if kind == "multi_worker":
        config = None
        found = cluster_tf_config()  # the source strategy_plan and is_chief read: a TF_CONFIG that names no
        if found is None or found[0] != "TF_CONFIG":  # cluster ('{"task": ...}' only) does not shadow Slurm
            if found is None or found[1] is None:
                raise ValueError(
                    "strategy='multi_worker' needs a cluster: set TF_CONFIG (see docs/fit.md), run under "
                    "`srun` with several tasks, or in a Kubernetes Indexed Job with KERAS_SCALE_NUM_WORKERS set."
                    + (" (TF_CONFIG is set but names no cluster.)" if tf_config() else "")
                )
            config = found[1]
        from keras_scale.heartbeat_file import write_beat

        write_beat("start")  # `keras-scale launch`: this worker got as far as joining the cluster
        result = _multi_worker(all_reduce, config)
    elif kind == "mirrored":
        candidates = (None, "one_device") if all_reduce == "auto" else (all_reduce,)
        result = mirrored_with_fallback(devices, candidates)
    else:
        if all_reduce != "auto":
            log.info("all_reduce=%r ignored: the default strategy has one device and no all-reduce", all_reduce)
        result = tf.distribute.get_strategy()
    log.info("strategy: %s with %d replica(s) (%s)", strategy_name(result), result.num_replicas_in_sync, reason)
    return result
