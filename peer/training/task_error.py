"""`TaskError`, on its own so that the built-in tasks (which `task` loads on use)
need not import `task` back. Users import it from `shoal.peer.training.task`."""


class TaskError(Exception):
    """A user-facing problem with a task (spec, config or data); the message is one line."""
