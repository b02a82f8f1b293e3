"""The composed train step (moved from keras_scale/step.py; split into one module per part next)."""
from keras_scale.step.composed import (
    DIAG_CAPACITY, SKIPPED_LOG_KEY, ComposedStep, DiagnosisSlot, _ThreadFlag, _all_gradients_finite,
    _has_synchronized_batchnorm, check_supported, check_wrappable, get_step, has_own_compute_loss,
    has_own_train_step, is_loss_scaled, make_train_function, overrides, rebuild, state_variables)

__all__ = ["ComposedStep", "get_step", "make_train_function", "rebuild", "state_variables", "overrides",
           "is_loss_scaled", "DiagnosisSlot", "DIAG_CAPACITY", "SKIPPED_LOG_KEY"]
_REEXPORTED = (check_supported, check_wrappable, has_own_train_step, has_own_compute_loss,
               _has_synchronized_batchnorm, _ThreadFlag, _all_gradients_finite)
