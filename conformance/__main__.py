"""``python -m conformance --impl NAME``: the conformance gate (see ``conformance.gate``)."""

import sys

from conformance.gate import main

sys.exit(main())
