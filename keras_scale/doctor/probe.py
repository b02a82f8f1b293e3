"""The TensorFlow probe of ``keras-scale doctor``: :mod:`keras_scale._tf_probe` run as a child process, started
first and collected last, so the caller's TensorFlow stays uninitialised and a TensorFlow that crashes or hangs on
import is reported instead of killing the doctor."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from typing import Any, Dict, Optional

from keras_scale._tf_probe import PROBE_MARK as _PROBE_MARK

_PROBE_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_tf_probe.py")


_LOG_HINT = re.compile(
    r"Could not load dynamic library|Cannot dlopen|Could not find cuda drivers|failed call to cuInit|"
    r"Loaded runtime CuDNN library|cuDNN.*version|Could not find TensorRT|libcu\w+\.so|Unknown flags? in|"
    r"PTX version|UNSUPPORTED_PTX|older than the PTX compiler|no kernel image|to read flags for environment",
    re.IGNORECASE)


# "Created device /job:localhost/replica:0/task:0/device:GPU:0 with 79078 MB memory:  -> device: 0, name: NVIDIA H100
# 80GB HBM3, pci bus id: 0000:18:00.0, compute capability: 9.0"
_CREATED_GPU = re.compile(r"Created device \S*device:GPU:(\d+) with .*?name: (.*?), pci bus id: ([0-9A-Fa-f:.]+)")


class _TfProbe:
    """The TensorFlow probe as a child process: started first, collected after the other facts are gathered."""

    def __init__(self, timeout_s: float = 180.0) -> None:
        self.timeout_s = timeout_s
        self.started_s = time.perf_counter()
        # TensorFlow's INFO log names each GPU's PCI bus id and the libraries it failed to load: keep it on
        self.proc = subprocess.Popen([sys.executable, _PROBE_SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0"))

    def result(self) -> Dict[str, Any]:
        left = max(1.0, self.timeout_s - (time.perf_counter() - self.started_s))
        try:
            stdout, stderr = self.proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            stdout, stderr = self.proc.communicate()
            return _probe_result(stdout, stderr, self.proc.returncode, timed_out_s=self.timeout_s)
        return _probe_result(stdout, stderr, self.proc.returncode)


def _probe_result(stdout: str, stderr: str, returncode: Optional[int],
                  timed_out_s: Optional[float] = None) -> Dict[str, Any]:
    """The probe's last reported state, with TensorFlow's telling log lines; a crash or hang said plainly."""
    result: Optional[Dict[str, Any]] = None
    for line in stdout.splitlines():
        if line.startswith(_PROBE_MARK):
            result = json.loads(line[len(_PROBE_MARK):])
    hints = [ln.strip()[:300] for ln in stderr.splitlines() if _LOG_HINT.search(ln)]
    created = [m.groups() for m in _CREATED_GPU.finditer(stderr)]
    finished = result is not None and result.get("stage") in ("done", "import")
    if result is None or not finished:
        stage = (result or {}).get("stage", "start-up")
        why = (f"did not finish within {timed_out_s:.0f} s (hung at: {stage})" if timed_out_s else
               f"exited with code {returncode} at: {stage}")
        tail = " | ".join(stderr.strip().splitlines()[-5:])[-800:]
        if result is None:
            result = {"tensorflow": None}
        result.update(crashed=True, error=f"the TensorFlow probe {why}: {tail}")
    result["log_hints"] = hints[:12]
    if created:
        result["gpu_pci_bus_ids"] = {i: bus for i, _, bus in created}
        result["gpu_names"] = {i: name for i, name, _ in created}
    return result


def _run_tf_probe(timeout_s: float = 180.0) -> Dict[str, Any]:
    """Run :func:`keras_scale._tf_probe.probe_tensorflow` in a child Python and wait for its result."""
    return _TfProbe(timeout_s).result()
