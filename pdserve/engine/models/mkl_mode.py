"""One MKL code path per CPU for the float32 kernels, so a row's bits cannot depend on its batch.

torch's CPU flash attention computes float32 through MKL's sgemm, once per (row, head) in
per-thread scratch buffers. Without MKL's conditional numerical reproducibility (CNR), MKL
may take a different code path by its operands' memory alignment: on an AMD EPYC (AVX-512,
torch 2.13) a row's float32 attention output changed with the batch size and the thread
count, so float32 decode was not batch-invariant even with ``--batch-invariant``. CNR's
``AUTO,STRICT`` fixes the path for the CPU and makes it independent of alignment; bfloat16
(oneDNN, not MKL) never depended on it. Measured cost on that CPU: within noise.

MKL reads ``MKL_CBWR`` once, at its first call in the process, so this has to run before
any torch op: :mod:`pdserve.engine.models.llama` calls it when it is imported. An operator's
own ``MKL_CBWR`` wins.
"""

from __future__ import annotations

import os

REPRODUCIBLE_MKL_MODE = "AUTO,STRICT"


def pin_mkl_code_path() -> None:
    """Ask MKL for its reproducible mode (unless the environment already chose one)."""
    os.environ.setdefault("MKL_CBWR", REPRODUCIBLE_MKL_MODE)
