"""kvx's synthetic workload, for tests and benchmarks that drive kvx from Python.

Each chunk's bytes derive from its request id and index, so a decoder can check every byte it
reads without knowing anything else. These are the functions ``kvx demo`` itself runs (native
code, in place, the GIL released), so that a Python-driven run and ``kvx demo`` make and check
their bytes at the same cost.
"""

from kvx._kvx import synthetic_check as check
from kvx._kvx import synthetic_fill as fill

__all__ = ["check", "fill"]
