"""`python -m shoal.peer`: the same as the `shoal` command."""

from .cli import main

raise SystemExit(main())
