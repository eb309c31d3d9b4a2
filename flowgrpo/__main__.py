"""``python -m flowgrpo ...`` (what ``accelerate launch -m flowgrpo train ...`` runs on every process)."""

import sys

from .cli import main

sys.exit(main())
