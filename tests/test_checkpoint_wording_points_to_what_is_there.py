"""What ``ls`` and ``ks.load_checkpoint`` say points to what is on disk and what happens next: a state file naming
another directory's checkpoint is kept aside as ``checkpoint.invalid`` by the next start (as it is); a directory
holding only ``best/`` (or ``final/``) names those paths."""
import os
import shutil

import pytest

import keras_scale as ks
from keras_scale.cli import main
from tests._helpers import fit, make_model


def test_ls_of_a_state_file_naming_another_directory_says_the_next_start_keeps_it_aside(tmp_path, capsys):
    other, d = str(tmp_path / "other"), str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(other)], epochs=1)
    fit(make_model(), [ks.ChiefCheckpoint(d)], epochs=1)
    with open(os.path.join(d, "checkpoint"), "w") as f:
        f.write(f'model_checkpoint_path: "{other}/ckpt-10"\nall_model_checkpoint_paths: "{other}/ckpt-10"\n')
    capsys.readouterr()
    assert main(["checkpoint", "ls", d]) == 0
    out = capsys.readouterr().out
    assert "which is not a checkpoint of this directory (ignored; the next ChiefCheckpoint start keeps a copy of " \
           "the state file as 'checkpoint.invalid'" in out
    with pytest.warns(RuntimeWarning, match="this start keeps a copy of the state file as 'checkpoint.invalid'"):
        fit(make_model(), [ks.ChiefCheckpoint(d)], epochs=2)  # (what ls said happens)
    assert os.path.exists(os.path.join(d, "checkpoint.invalid"))


def test_load_checkpoint_of_a_directory_with_only_best_names_the_paths_that_load(tmp_path):
    d = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(d, keep_best_k=1, monitor="loss")], epochs=2)
    only = str(tmp_path / "only_best")
    os.makedirs(only)
    shutil.copytree(os.path.join(d, "best"), os.path.join(only, "best"))
    with pytest.raises(FileNotFoundError, match=r"Its best/ holds ckpt-20 \(keep_best_k\): pass '.*only_best/best' "
                                                r"\(the newest of them\), step=20"):
        ks.load_checkpoint(make_model(), only)
    assert ks.load_checkpoint(make_model(), os.path.join(only, "best")) == os.path.join(only, "best", "ckpt-20")
    assert ks.load_checkpoint(make_model(), only, step=20) == os.path.join(only, "best", "ckpt-20")
