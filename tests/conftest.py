"""Shared pytest configuration: hypothesis profiles.

Select one with ``HYPOTHESIS_PROFILE=ci|dev|gpu``; the default is ``ci`` when the ``CI`` variable
is set (derandomized, so a CI failure reproduces locally) and ``dev`` otherwise.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# deadline=None everywhere: the first example of a test may build caches or compile, which says
# nothing about the code's speed and would make timing-based deadlines flaky.
settings.register_profile("ci", derandomize=True, max_examples=25, deadline=None, print_blob=True)
settings.register_profile("dev", max_examples=40, deadline=None)
settings.register_profile(
    "gpu",
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
