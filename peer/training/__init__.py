"""The training core custom tasks build on: the task API, built-in tasks and the inner loop."""
