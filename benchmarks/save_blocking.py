"""Does one epoch-end save of a small model block the training thread much longer than the others?

Each repeat runs, in a fresh process, a single-process ``ks.fit`` of a ~15 KB regression model (Adam, 5 epochs,
``checkpoint_dir`` and ``log_dir``) and reads back each save's ``blocked_s`` (ChiefCheckpoint's record), the save's
thread CPU time, and the garbage collections that ran inside it (``gc.callbacks``). Printed: per save index, the
median blocked time over the repeats and its ratio to the median of all saves; the wall/CPU split says whether a
slow save computed (CPU) or waited (the machine's other processes, the GIL, I/O); a gen-2 collection inside a save
is listed with its CPU time (a full pass over every Python object of a TensorFlow process); with ``--async-save``,
the traces of TensorFlow's async copy function that ran inside a save (on the training thread).

The verdict: a save index whose median blocked time is over 2x the median of all saves is named slow.

Found with it (``--async-save``, 8 repeats): TensorFlow's async checkpoint copies the variables eagerly at the first
save and traces its ``_copy_to_cpu`` tf.function (autograph) at the second, on the training thread: save 2 blocked
a median 5x the others (0.23-0.49 s for a 15 KB model). ChiefCheckpoint now traces it in a background thread right
after the first save (checkpoint/warmup.py); ``--root`` runs another checkout (e.g. the commit before) beside it.

    python benchmarks/save_blocking.py [--repeats 8] [--async-save] [--verbose 1] [--root DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r'''
import gc, json, os, sys, time
sys.path.insert(0, sys.argv[1])
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras, numpy as np, keras_scale as ks
from keras_scale import events
from keras_scale.callbacks.checkpoint import callback as cbm
os.chdir(sys.argv[2])
async_save, verbose = sys.argv[3] == "1", int(sys.argv[4])
if async_save:
    init = cbm.ChiefCheckpoint.__init__
    def async_init(self, *args, **kwargs):
        kwargs["async_save"] = True
        init(self, *args, **kwargs)
    cbm.ChiefCheckpoint.__init__ = async_init
def copy_traces(ckpt):
    helper = getattr(ckpt._checkpoint, "_async_checkpointer_impl", None)
    copy = getattr(helper, "_copy_to_cpu", None) if getattr(helper, "_initialized", False) else None
    return copy.experimental_get_tracing_count() if copy is not None else None
traces = []
state = {"in": False, "gcs": [], "t": 0.0, "c": 0.0}
def on_gc(phase, info):
    if phase == "start":
        state["t"], state["c"] = time.perf_counter(), time.thread_time()
    elif state["in"]:
        state["gcs"][-1].append([info["generation"], time.perf_counter() - state["t"], time.thread_time() - state["c"]])
gc.callbacks.append(on_gc)
saves = []
original = cbm.ChiefCheckpoint._save
def timed(self, *args, **kwargs):
    state["in"] = True
    state["gcs"].append([])
    before = copy_traces(self)
    wall, cpu = time.perf_counter(), time.thread_time()
    try:
        return original(self, *args, **kwargs)
    finally:
        state["in"] = False
        saves.append([time.perf_counter() - wall, time.thread_time() - cpu])
        traces.append(copy_traces(self) - before if before is not None else 0)
cbm.ChiefCheckpoint._save = timed
rng = np.random.default_rng(0)
x = rng.normal(size=(2048, 16)).astype("float32")
y = x[:, :1] * 2.0
def build():
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    return model
ks.fit(build, x, y, per_replica_batch_size=64, epochs=5, verbose=verbose, checkpoint_dir="ckpt", log_dir="logs")
blocked = [e["blocked_s"] for e in events.read("logs") if e["kind"] == "checkpoint"]
print(json.dumps({"blocked_s": blocked, "wall_cpu_s": saves, "gc": state["gcs"], "traces": traces}))
'''


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--async-save", action="store_true", help="ChiefCheckpoint(async_save=True) (default: sync)")
    p.add_argument("--verbose", type=int, default=0, help="ks.fit's verbose")
    p.add_argument("--root", default=ROOT, help="the keras_scale checkout to run (default: this one)")
    args = p.parse_args()
    runs = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as work:
            out = subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(args.root), work,
                                  "1" if args.async_save else "0", str(args.verbose)], capture_output=True, text=True,
                                 timeout=900)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    saves = min(len(r["blocked_s"]) for r in runs)
    overall = statistics.median(b for r in runs for b in r["blocked_s"][:saves])
    print(f"{args.repeats} fresh-process ks.fit runs ({'async' if args.async_save else 'sync'} saves, verbose="
          f"{args.verbose}, {args.root}), {saves} epoch-end saves each; median blocked of all saves "
          f"{overall * 1e3:.1f} ms")
    print("save  median ms  median/all  max ms  max/all  wall/cpu ms (each run)        gen-2 GCs (cpu ms)  copy traces")
    slow = []
    for i in range(saves):
        blocked = [r["blocked_s"][i] for r in runs]
        split = " ".join(f"{w * 1e3:.0f}/{c * 1e3:.0f}" for w, c in (r["wall_cpu_s"][i] for r in runs))
        gcs = [f"{g[2] * 1e3:.0f}" for r in runs for g in r["gc"][i] if g[0] == 2]
        traced = sum(r["traces"][i] for r in runs)
        median = statistics.median(blocked)
        if median > 2 * overall:
            slow.append(f"save {i + 1} (median {median / overall:.1f}x all saves')")
        print(f"{i + 1:>4}  {median * 1e3:>9.1f}  {median / overall:>10.2f}  {max(blocked) * 1e3:>6.0f}  "
              f"{max(blocked) / overall:>7.1f}  {split:<29} {', '.join(gcs) or '-':<19} {traced}")
    print("verdict: " + (f"slow: {', '.join(slow)}" if slow else
                         "no save index blocks over 2x the median of all saves"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
