"""Checkpoints others can load: `shoal export` and `shoal run --init-from` (weights.py)."""

from .weights import (
    EXPERIMENT_FILE,
    EXPORT_FORMATS,
    WEIGHTS_FILE,
    ExportError,
    SavedExperiment,
    export_checkpoint,
    find_saved_experiment,
    load_initial_weights,
)

__all__ = [
    "EXPERIMENT_FILE",
    "EXPORT_FORMATS",
    "WEIGHTS_FILE",
    "ExportError",
    "SavedExperiment",
    "export_checkpoint",
    "find_saved_experiment",
    "load_initial_weights",
]
