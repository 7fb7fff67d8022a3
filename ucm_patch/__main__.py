"""``python -m ucm_patch`` = ``ucm-patch``."""

import sys

from ucm_patch.cli import main

sys.exit(main())
