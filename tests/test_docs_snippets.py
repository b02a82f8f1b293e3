"""Every code block of README.md and docs/*.md runs, or says why it does not.

How the blocks are read (the rules a doc writer follows):

- A ```` ```python ```` block runs: all blocks of one file in order, in one namespace (a later block may use an
  earlier block's names), in a temporary working directory, on CPU. The docs use small numbers (epochs, steps),
  so nothing is substituted.
- A comment line ``<!-- snippet: setup=NAME -->`` right before a block first runs the prelude ``NAME`` below,
  which defines the names a reader brings along (``model``, ``ds``, ``x``, ``y``, ``images``, ...), with
  small generated data.
- ``<!-- snippet: not run: REASON -->`` right before a block skips it; the reason is required. Shell blocks
  (```` ```bash ````) must carry it (they start processes, clusters or the whole suite).
- A block without a language is output shown to the reader (a printed table, a log), not code.
"""
import contextlib
import glob
import io
import os
import re

import pytest

from tests.conftest import REPO_ROOT

DOCS = ["README.md"] + sorted(os.path.relpath(p, REPO_ROOT) for p in glob.glob(os.path.join(REPO_ROOT, "docs", "*.md")))

FENCE = re.compile(r"^(?:<!-- snippet: (?P<marker>.*?) -->\n)?```(?P<lang>[\w-]*)\n(?P<body>.*?)^```\s*$", re.S | re.M)

SETUPS = {
    # a small classifier: `my_model()` builds one uncompiled, `build_model()` builds and compiles one, `model` is
    # a compiled one; `ds` yields 8 batches of 16 samples (8 features, 10 classes)
    "classifier": """
import keras, numpy as np, tensorflow as tf
import keras_scale as ks

def my_model():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(10, activation="softmax")])

def build_model():
    model = my_model()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model

_rng = np.random.default_rng(0)
x = _rng.normal(size=(128, 8)).astype("float32")
y = _rng.integers(0, 10, size=128)
ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
model = build_model()
""",
    # regression arrays with 16 features (docs/fit.md's own builder)
    "regression16": """
import numpy as np
_rng = np.random.default_rng(0)
x = _rng.normal(size=(256, 16)).astype("float32")
y = x[:, :1] * 2.0
""",
    # a small image set for the input-pipeline lint
    "images": """
import numpy as np
images = np.zeros((1000, 32, 32, 3), "float32")
labels = np.zeros((1000,), "int64")
""",
}


def blocks(path):
    """(line, language, marker, body) of each fenced block of ``path``."""
    with open(os.path.join(REPO_ROOT, path)) as f:
        text = f.read()
    for m in FENCE.finditer(text):
        yield text[:m.start("lang")].count("\n") + 1, m.group("lang"), m.group("marker"), m.group("body")


def test_every_block_is_run_or_says_why_not():
    problems = []
    for path in DOCS:
        for line, lang, marker, _ in blocks(path):
            where = f"{path}:{line}"
            if marker is not None and not (marker.startswith("setup=") and marker[6:] in SETUPS
                                           or re.fullmatch(r"not run: \S.*", marker)):
                problems.append(f"{where}: unknown marker {marker!r} (setup=NAME with NAME in {sorted(SETUPS)}, "
                                f"or 'not run: REASON')")
            if lang and lang != "python" and not (marker or "").startswith("not run:"):
                problems.append(f"{where}: a ```{lang} block needs <!-- snippet: not run: REASON -->")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", DOCS)
def test_python_blocks_run(path, tmp_path, monkeypatch):
    runnable = [(line, marker, body) for line, lang, marker, body in blocks(path)
                if lang == "python" and not (marker or "").startswith("not run:")]
    if not runnable:
        pytest.skip(f"{path} has no runnable python block")
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs__"}
    for line, marker, body in runnable:
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                if marker and marker.startswith("setup="):
                    exec(compile(SETUPS[marker[6:]], f"<setup {marker[6:]}>", "exec"), namespace)
                exec(compile(body, f"{path}:{line}", "exec"), namespace)
        except Exception as e:  # noqa: BLE001 - name the block, keep the original traceback
            raise AssertionError(f"the block at {path}:{line} failed: {type(e).__name__}: {e}\n"
                                 f"its output:\n{out.getvalue()[-2000:]}") from e
