"""``python -m pagedbench.refengine generate --model tiny --prompt-ids 1,2,3``: see :mod:`.cli`."""

import sys

from pagedbench.refengine.cli import main

sys.exit(main())
