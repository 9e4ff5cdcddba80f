"""``python -m schedules demo | explain`` (see ``schedules.cli``; installed as ``sdpa-fusion``)."""

import sys

from .cli import main

sys.exit(main())
