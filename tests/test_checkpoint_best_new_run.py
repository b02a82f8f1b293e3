"""keep_best_k ranks the new run only: a new run in a directory (``on_completed="restart"``, ``restore=False``)
sets the earlier run's ``best/`` checkpoints aside in ``best/earlier-run-to-ckpt-<step>/`` (kept, never ranked
again), so neither that run nor a later rerun of it ranks the old ones above (or deletes) the new run's bests."""
import json
import os
import warnings

import keras
import pytest

import keras_scale as ks
from keras_scale.callbacks.checkpoint.export import describe_directory
from keras_scale.cli import main
from tests._helpers import fit, make_model


def best_numbers(d):
    with open(os.path.join(d, "best", "best.json")) as f:
        return [e["number"] for e in json.load(f)]


def ckpt(d, **kw):
    return ks.ChiefCheckpoint(d, max_to_keep=3, keep_best_k=2, monitor="loss", **kw)


@pytest.mark.parametrize("how", ["restart", "restore_false"])
def test_a_new_run_ranks_only_its_own_best_checkpoints_and_a_rerun_keeps_them(tmp_path, capsys, how):
    """Before: the old run's best/ files stayed there unranked; the new run ranked only its own (worse) ones
    (on_completed='restart') or never entered best/ at all (restore=False); a plain rerun then ranked the old ones
    back in and deleted the new run's bests. Now the old ones are moved aside, nothing is deleted."""
    d = str(tmp_path / "ckpt")
    fit(make_model(), [ckpt(d)], epochs=6)  # a low loss: the old run's bests beat anything the new run reaches
    old = best_numbers(d)
    assert old == [60, 50]
    new_run = dict(on_completed="restart") if how == "restart" else dict(restore=False)
    slow = lambda: keras.optimizers.Adam(1e-6)  # noqa: E731 - (a new run whose losses stay high)
    with pytest.warns(RuntimeWarning, match=r"best checkpoints in best/ \(ckpt-50, ckpt-60\) are moved aside"):
        fit(make_model(optimizer=slow), [ckpt(d, **new_run)], epochs=2)
    assert best_numbers(d) == [80, 70]
    aside = os.path.join(d, "best", "earlier-run-to-ckpt-60")
    assert sorted(n for n in os.listdir(aside) if n.endswith(".index")) == ["ckpt-50.index", "ckpt-60.index"]
    with open(os.path.join(aside, "best.json")) as f:
        assert [e["number"] for e in json.load(f)] == old  # the old ranking kept too
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a plain rerun finds nothing to repair
        fit(make_model(optimizer=slow), [ckpt(d)], epochs=2)
    assert best_numbers(d) == [80, 70]
    assert all(os.path.exists(os.path.join(d, "best", f"ckpt-{n}.index")) for n in (70, 80))
    info = describe_directory(d)
    assert not info["problems"]
    assert info["earlier_best"] == [{"directory": aside, "checkpoints": [50, 60]}]
    capsys.readouterr()
    assert main(["checkpoint", "ls", d]) == 0
    listing = capsys.readouterr().out
    assert "best of an earlier run (set aside when a new run started; kept, never ranked): " \
           "best/earlier-run-to-ckpt-60/ (ckpt-50, ckpt-60)" in listing
