"""A resumable training script for a cluster scheduler: the worker program of ``examples/slurm/train.sbatch`` and
``examples/kubernetes/train-job.yaml`` (and of ``keras-scale launch --max-restarts``).

    python examples/train_resumable.py --checkpoint-dir /shared/run1/ckpt --epochs 20

Run the same command on every worker. ``keras_scale.choose_strategy()`` finds the cluster in TF_CONFIG, the Slurm
step's variables or the Kubernetes Indexed Job's pod index; ``keras_scale.fit(global_batch_size=...)`` resumes
from ``--checkpoint-dir`` (same global batch on any number of workers); SIGTERM/SIGUSR1 (preemption) saves and
exits 42, which the templates requeue / restart on. Prints one JSON line per worker at the end.
"""
from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint-dir", required=True, help="shared directory: every worker sees the same one")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--samples", type=int, default=256, help="size of the synthetic data set")
    parser.add_argument("--step-delay-s", type=float, default=0.0, help="sleep per step (to make a demo slower)")
    args = parser.parse_args(argv)

    import keras_scale as ks
    from keras_scale.distribute import cluster_task

    source, _, index, workers = cluster_task()  # where the cluster comes from (before TF_CONFIG is derived from it)
    strategy = ks.choose_strategy()  # first: before any TensorFlow op (MultiWorkerMirroredStrategy needs it)
    import keras
    import numpy as np

    x = np.random.default_rng(0).normal(size=(args.samples, 8)).astype("float32")
    y = (x @ np.linspace(-1.0, 1.0, 8, dtype="float32")[:, None]).astype("float32")

    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        return model

    goodput = ks.Goodput(verbose=0)  # ks.fit would add one; this one is read below
    callbacks = [goodput]
    if args.step_delay_s:
        import time

        callbacks.append(keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: time.sleep(args.step_delay_s)))
    history = ks.fit(build, x, y, global_batch_size=args.global_batch_size, epochs=args.epochs, strategy=strategy,
                     checkpoint_dir=args.checkpoint_dir, callbacks=callbacks, verbose=0)
    print(json.dumps({"source": source, "index": index, "workers": workers, "chief": ks.is_chief(strategy),
                      "replicas": strategy.num_replicas_in_sync, "loss": history.history.get("loss", [None])[-1],
                      "steps_this_run": goodput.summary.get("steps"),
                      "global_step": int(ks.unwrap(history.model).optimizer.iterations.numpy())}),
          flush=True)


if __name__ == "__main__":
    main()
