"""Shared test settings: small hypothesis budgets (CI has 2 cores) and no deadlines (the first
example of a property compiles its program)."""

import os

from hypothesis import HealthCheck, settings

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Several workers may share one accelerator: none may claim most of its memory up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Examples a property, by profile (HYPOTHESIS_PROFILE): "ci" by default; "quick" for checks
# on the GPU machine, whose time is rationed; "thorough" for hunting rare cases by hand.
for name, examples in {"ci": 25, "quick": 5, "thorough": 300}.items():
    settings.register_profile(
        name,
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
