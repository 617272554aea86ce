"""`shoal.peer.task`, kept for existing custom tasks: the API is in `shoal.peer.training.task`."""

from shoal.peer.training.task import (
    BUILTIN_TASKS,
    Task,
    TaskError,
    TaskFactory,
    load_task,
    shard_of,
    trains_on_private_data,
)

__all__ = [
    "BUILTIN_TASKS",
    "Task",
    "TaskError",
    "TaskFactory",
    "load_task",
    "shard_of",
    "trains_on_private_data",
]
