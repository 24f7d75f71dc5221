"""``python -m pagedbench.conformance --impl NAME``: the conformance gate (see ``conformance.gate``)."""

import sys

from pagedbench.conformance.gate import main

sys.exit(main())
