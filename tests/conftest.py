"""Suite-wide test settings.

Hypothesis fails any example slower than 200 ms by default: a timing assertion in every
property test that forgets ``deadline=None``. The suite asserts behaviour only (time limits
belong to pytest-timeout and the benchmarks), so the deadline is off for every test.
"""

from hypothesis import settings

settings.register_profile("pdserve", deadline=None)
settings.load_profile("pdserve")
