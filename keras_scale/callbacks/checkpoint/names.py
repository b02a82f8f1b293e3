"""Names shared by the parts of ChiefCheckpoint: file names, checkpoint keys, the error type."""
from __future__ import annotations

import logging
import re

log = logging.getLogger("keras_scale.checkpoint")

_NAME = "ckpt"

_INDEX_RE = re.compile(r"^" + _NAME + r"-(\d+)\.index$")

_PREFIX_RE = re.compile(r"^" + _NAME + r"-(\d+)$")

_SIGNATURE_KEY = "keras_scale_signature/.ATTRIBUTES/VARIABLE_VALUE"

_EPOCH_LOGS_KEY = "keras_scale_epoch_logs/.ATTRIBUTES/VARIABLE_VALUE"

_RUN_CONFIG_KEY = "keras_scale_run_config/.ATTRIBUTES/VARIABLE_VALUE"

_METRIC_KEY = "metrics_variables/{}/.ATTRIBUTES/VARIABLE_VALUE"

_EPOCH_SKIPPED_KEY = "keras_scale_epoch_skipped/.ATTRIBUTES/VARIABLE_VALUE"

_POSITION = ("epoch", "step_in_epoch", "stream_pos", "global_step", "batch_size")

_BEST_DIR = "best"

_REF_ATTR = "_keras_scale_checkpoint_ref"

class CheckpointMismatchError(ValueError):
    """A checkpoint in the directory was written for a different model (weight count or shapes differ)."""

