"""Shared test settings: small hypothesis budgets (CI has 2 cores) and no deadlines (the first
example of a property compiles its program)."""

import os

from hypothesis import HealthCheck, settings

os.environ.setdefault("JAX_PLATFORMS", "cpu")

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
# A few examples a property: for checks on the GPU machine, whose time is rationed.
settings.register_profile(
    "quick",
    max_examples=5,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
# Many examples a property: for hunting rare cases by hand (HYPOTHESIS_PROFILE=thorough).
settings.register_profile(
    "thorough",
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
