"""``keras-scale checkpoint ls`` says where each checkpoint was taken as Keras counts epochs (the end of epoch 3 of a
3-epoch run, not "epoch 4, batch 0"), where a resumed fit continues, and, given the parent of the checkpoint
directory, which sub-directory holds them."""
import os
import shlex

import keras
import numpy as np
import pytest

import keras_scale as ks
from keras_scale.cli import main


@pytest.fixture(scope="module")
def three_epoch_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "s 1"  # a space: the printed command must quote it
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((32, 4), "float32")
    model.fit(x, x[:, :1], batch_size=8, epochs=3, verbose=0,
              callbacks=[ks.ChiefCheckpoint(str(run / "ckpt"), verbose=0)])
    return run


def test_ls_says_the_end_of_the_last_epoch_and_where_a_resume_continues(three_epoch_run, capsys):
    assert main(["checkpoint", "ls", str(three_epoch_run / "ckpt")]) == 0
    out = capsys.readouterr().out
    newest = next(line for line in out.splitlines() if "<-" in line)  # the run completed there: said, and what next
    assert "saved at the end of epoch 3" in newest and "the completed run's final state" in newest, out
    assert "completed at epoch 3" in out and "with a larger epochs= it continues at epoch 4" in out, out
    assert "epoch 4" not in newest.split("<-")[0], out


def test_ls_on_the_parent_points_to_the_checkpoint_directory(three_epoch_run, capsys):
    assert main(["checkpoint", "ls", str(three_epoch_run)]) == 0
    out = capsys.readouterr().out
    assert "0 checkpoint(s)" in out
    hint = out.split("keras-scale checkpoint ls ", 1)[1].splitlines()[0]
    assert shlex.split(hint) == [os.path.join(str(three_epoch_run), "ckpt")], out  # runs as printed
    assert main(["checkpoint", "ls", *shlex.split(hint)]) == 0
    assert "3 checkpoint(s)" in capsys.readouterr().out


def test_ls_on_the_tensorboard_log_dir_points_to_the_checkpoints_its_run_saved(tmp_path, capsys):
    # `TensorBoard("logs")` and `ChiefCheckpoint("ckpt")` side by side: `ls logs` names ckpt, from the run's events
    logs, ckpt = tmp_path / "my logs", tmp_path / "ck pt"
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((16, 4), "float32")
    model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0,
              callbacks=[keras.callbacks.TensorBoard(str(logs)), ks.Goodput(log_dir=str(logs)),
                         ks.ChiefCheckpoint(str(ckpt), verbose=0)])
    capsys.readouterr()
    assert main(["checkpoint", "ls", str(logs)]) == 0
    out = capsys.readouterr().out
    assert "0 checkpoint(s)" in out and "keras-scale checkpoint ls " in out, out
    hint = out.split("keras-scale checkpoint ls ", 1)[1].splitlines()[0]
    assert shlex.split(hint) == [os.path.abspath(str(ckpt))], out
    assert main(["checkpoint", "ls", *shlex.split(hint)]) == 0
    assert "1 checkpoint(s)" in capsys.readouterr().out
