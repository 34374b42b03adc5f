"""The soak (``make soak``): collected only with PDSERVE_SOAK=1, so ``make test`` neither runs it nor
reports it as skipped. It takes about 10-15 minutes on 2 cores."""

from __future__ import annotations

import os

if not os.environ.get("PDSERVE_SOAK"):
    collect_ignore_glob = ["test_*.py"]
