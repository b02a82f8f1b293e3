"""The distribution: the sdist runs its own tests (conftest, fakes), ships LICENSE and py.typed, states its floors."""
import os
import shutil
import subprocess
import sys
import tarfile

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ["keras_scale", "keras_scale_cli.py", "tests", "docs", "examples", "benchmarks", "README.md", "LICENSE",
           "Makefile", "pyproject.toml", "MANIFEST.in"]


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    """Build the sdist from a copy of the source tree (the build writes egg-info next to the sources)."""
    pytest.importorskip("setuptools", minversion="77")  # PEP 639 license expression; in the [test] extra
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", ".pytest_cache")
    for name in SOURCES:
        path = os.path.join(REPO_ROOT, name)
        if os.path.isdir(path):
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy(path, src / name)
    out = tmp_path_factory.mktemp("dist")
    code = "import sys, setuptools.build_meta as b; print(b.build_sdist(sys.argv[1]))"
    proc = subprocess.run([sys.executable, "-c", code, str(out)], cwd=str(src), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    archive = tarfile.open(out / proc.stdout.strip().splitlines()[-1])
    root = archive.getnames()[0].split("/")[0]
    return archive, root


def test_sdist_ships_runnable_tests_license_and_typing_marker(sdist):
    archive, root = sdist
    names = {n[len(root) + 1:] for n in archive.getnames()}
    tracked = subprocess.run(["git", "ls-files", "tests", "keras_scale"], cwd=REPO_ROOT, capture_output=True,
                             text=True).stdout.split()
    expected = {"LICENSE", "README.md", "keras_scale_cli.py", "keras_scale/py.typed", "tests/conftest.py",
                "tests/__init__.py", "tests/fakes/__init__.py", "tests/fakes/fake_nvml.py",
                "keras_scale/data_files/cuda_driver_minimums.json"}
    expected |= {t for t in tracked if t.endswith((".py", ".json", ".typed"))}
    assert expected - names == set()
    license_text = archive.extractfile(f"{root}/LICENSE").read().decode()
    assert "Apache License" in license_text and "Version 2.0" in license_text


def test_sdist_metadata_states_license_floors_and_entry_point(sdist):
    archive, root = sdist
    pkg_info = archive.extractfile(f"{root}/PKG-INFO").read().decode()
    assert "License: Apache-2.0" in pkg_info or "License-Expression: Apache-2.0" in pkg_info
    import keras_scale

    assert f"Version: {keras_scale.__version__}" in pkg_info
    requires = archive.extractfile(f"{root}/keras_scale.egg-info/requires.txt").read().decode().split()
    assert "keras>=3.10" in requires and "tensorflow>=2.16" in requires
    entry_points = archive.extractfile(f"{root}/keras_scale.egg-info/entry_points.txt").read().decode()
    assert "keras-scale = keras_scale_cli:main" in entry_points


def test_sdist_and_wheel_ship_the_dashboard_plugin_and_its_front_end(sdist, tmp_path):
    archive, root = sdist
    names = {n[len(root) + 1:] for n in archive.getnames()}
    assert "keras_scale/tensorboard_plugin/static/index.js" in names
    entry_points = archive.extractfile(f"{root}/keras_scale.egg-info/entry_points.txt").read().decode()
    assert "[tensorboard_plugins]" in entry_points
    assert "keras_scale = keras_scale.tensorboard_plugin:KerasScalePlugin" in entry_points
    # the wheel built from that sdist (what pip installs) carries the front end too
    archive.extractall(tmp_path)
    code = "import sys, setuptools.build_meta as b; print(b.build_wheel(sys.argv[1]))"
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "wheel")], cwd=str(tmp_path / root),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import zipfile

    wheel = zipfile.ZipFile(tmp_path / "wheel" / proc.stdout.strip().splitlines()[-1])
    assert "keras_scale/tensorboard_plugin/static/index.js" in wheel.namelist()


def test_one_python_floor_in_the_metadata_and_doctor():
    """pyproject's requires-python, its Python classifiers and doctor's warning agree on one floor."""
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    import importlib

    doctor = importlib.import_module("keras_scale.doctor")  # the module (keras_scale.doctor is also the function)
    floor = ".".join(map(str, doctor.PYTHON_FLOOR))
    assert project["requires-python"] == f">={floor}"
    versions = sorted((tuple(map(int, c.rsplit(" ", 1)[1].split("."))) for c in project["classifiers"]
                       if c.startswith("Programming Language :: Python :: 3.")))
    assert versions[0] == doctor.PYTHON_FLOOR and versions == [(3, m) for m in range(versions[0][1], 14)]
    below = f"{doctor.PYTHON_FLOOR[0]}.{doctor.PYTHON_FLOOR[1] - 1}.9"
    assert doctor.check_python(doctor.Facts(python_version=below)).status == "warn"
    assert doctor.check_python(doctor.Facts(python_version=f"{floor}.0")).status == "ok"
