"""``python -m loglinear``: the ``loglinear`` command."""

from loglinear.cli import main

raise SystemExit(main())
