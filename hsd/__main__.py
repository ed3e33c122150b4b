"""``python -m hsd``: the same as the ``hsd`` console script. Guarded, so a walk over every module
(the wheel smoke test imports them all) does not run the command line."""

from __future__ import annotations

import sys

from hsd.cli import main

if __name__ == "__main__":
    sys.exit(main())
