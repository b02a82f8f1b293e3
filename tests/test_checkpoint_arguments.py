"""ChiefCheckpoint checks its arguments when it is made, with an error that says what to pass."""
import pytest

import keras_scale as ks


@pytest.mark.parametrize("verbose", ["auto", -1, True, "1"])
def test_checkpoint_refuses_a_verbose_it_cannot_honour_with_a_clear_error(tmp_path, verbose):
    with pytest.raises(ValueError, match=r"ChiefCheckpoint: verbose must be an integer >= 0, got .*Use 0"):
        ks.ChiefCheckpoint(str(tmp_path / "ckpt"), verbose=verbose)
