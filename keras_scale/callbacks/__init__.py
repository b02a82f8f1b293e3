"""keras_scale callbacks, one per file: NanGuard, ChiefCheckpoint, GpuMonitor, ProfileWindow, HostMemoryWatch.

Import them from the top-level package (``keras_scale.NanGuard``); this package holds their files.
"""
