"""`shoal.peer.tasks.corpus`, kept for existing specs: now `shoal.peer.training.tasks.corpus`."""

import sys

from shoal.peer.training.tasks import corpus as _moved

# The import system returns whatever sits in sys.modules under this name once the
# module has run, so both names give one module object (one set of classes).
sys.modules[__name__] = _moved
