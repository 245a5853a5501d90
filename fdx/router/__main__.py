"""``python -m fdx.router``: the same as ``fdx router`` (see :mod:`fdx.router.main`)."""

import os
import sys

from fdx.router.main import main

os.environ.setdefault("PYTHONUNBUFFERED", "1")
sys.exit(main())
