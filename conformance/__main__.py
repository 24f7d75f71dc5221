"""``python -m pagedbench.conformance --impl NAME``: the conformance gate (see ``conformance.gate.runner``)."""

import sys

from pagedbench.conformance.gate.runner import main

sys.exit(main())
