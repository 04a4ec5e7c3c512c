"""The hypothesis profiles of a gate run and what they scale.

``ci``: derandomized, no shrinking, no example database (the pull-request gate); ``dev``:
random, a third of the examples; ``nightly``: random, eight times the examples.
Registering a profile changes nothing until one is loaded, which only an attncheck run
does (``attncheck.session``).
"""

from __future__ import annotations

import hashlib
import os

from hypothesis import HealthCheck, Phase, settings
from hypothesis.internal.conjecture import providers
from hypothesis.internal.constants_ast import Constants

# The CI profile skips shrinking: interpret mode makes each shrink step cost seconds, and
# the recorded case id already is an exact, one-command reproducer.
CI_PHASES = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target)
# Examples per (spec, backend) are set by each spec for the ci profile; others scale them.
PROFILE_SCALE = {"dev": 0.34, "ci": 1.0, "nightly": 8.0}
# Of a gate test's drawn cases, how many share one program (KernelSpec.variants): in the
# pull-request profiles a compile is most of a cold case's time; the nightly draws a program
# per case, for the most static configurations.
CASES_PER_PROGRAM = {"dev": 4, "ci": 4, "nightly": 1}
# But a test draws at least this many programs (or a program per case, where it draws
# fewer cases): a spec that draws few cases still varies its static parameters (a run
# fails a parameter it never varied, attncheck.parameters).
MIN_PROGRAMS = 4

settings.register_profile(
    "ci", derandomize=True, deadline=None, print_blob=True, database=None, phases=CI_PHASES,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "dev", deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "nightly", deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _no_local_constants() -> Constants:
    return Constants()


# Hypothesis mixes literals found in the loaded local modules into its draws; which
# modules a worker has loaded depends on test order and worker count, so a derandomized
# run would draw different cases on different runners. The gate draws without them.
providers._get_local_constants = _no_local_constants
providers.CONSTANTS_CACHE.cache.clear()


def wide() -> bool:
    """Whether static shapes are drawn from the wide set (the nightly profile's), not from
    the few buckets of the CI profile (``strategies.Shapes``)."""
    return settings.get_current_profile_name() == "nightly"


def load_default() -> None:
    """The profile of a run that named none: ``ci`` under CI, else ``dev``."""
    settings.load_profile("ci" if os.environ.get("CI", "").lower() in ("1", "true", "yes") else "dev")


def examples_for(base: int) -> int:
    """Scale a spec's CI example count to the active hypothesis profile."""
    scale = PROFILE_SCALE.get(settings.get_current_profile_name(), 1.0)
    return max(1, round(base * scale))


def cases_per_program(cases: int) -> int:
    """How many of a test's ``cases`` drawn cases share each drawn program, in the active
    profile."""
    return max(1, min(CASES_PER_PROGRAM.get(settings.get_current_profile_name(), 1), cases // MIN_PROGRAMS))


def draw_seed(*names: str) -> int | None:
    """The seed of a gate test's draws under a derandomized profile, from what the test
    verifies (family, backend): hypothesis would otherwise derive it from the test
    function's source, so any edit of the test body would change every case drawn. None
    (hypothesis' own random seed) in the other profiles."""
    if not settings.default.derandomize:
        return None
    return int.from_bytes(hashlib.sha256("/".join(names).encode()).digest()[:8], "little")
