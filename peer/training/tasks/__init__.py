"""Built-in training tasks (`bytegpt`) and the corpus helpers that custom tasks can reuse.

Nothing is imported here, so that `shoal.peer.training.task` can list the built-in tasks
without loading torch; import `shoal.peer.training.tasks.bytegpt` or
`shoal.peer.training.tasks.corpus` directly.
"""
