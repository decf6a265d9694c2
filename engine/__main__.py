"""``python -m evenflow.engine``: the ``evenflow`` command without the installed script."""

from evenflow.engine._tools.cli import main

raise SystemExit(main())
