"""`shoal.peer.tasks.*`, kept for specs and tasks that name it: see `shoal.peer.training.tasks`.

`shoal.peer.tasks.bytegpt` and `shoal.peer.tasks.corpus` are the very modules of
`shoal.peer.training.tasks` (the same objects, not copies), so a manifest that
names `shoal.peer.tasks.bytegpt:make_task` still loads the built-in task.
"""
