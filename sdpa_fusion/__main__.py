"""``python -m sdpa_fusion demo | explain`` (see ``sdpa_fusion.cli``)."""

import sys

from .cli import main

sys.exit(main())
