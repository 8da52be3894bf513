"""Root configuration (doctests in optclip/ too): 8 host CPU devices, a persistent compilation
cache, hypothesis profiles."""

import os

# Must happen before jax is imported anywhere: 8 host CPU devices for the sharding tests, beside
# any other XLA flags already set (`make test` sets some for its floor run), unless a count is.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]).strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Compiling is most of the suite's time. Every compiled step goes to a cache on disk that both
# xdist workers share: a step that another test (or worker, or an earlier run) has compiled is
# read back instead of compiled again. Keyed on the lowered program, the compile options and
# the jax/jaxlib versions, so changed code or the floor pins never read a stale entry; compiled
# HLO text, which the cost tests read, comes back with a cached executable.
jax.config.update("jax_compilation_cache_dir", os.environ.get(
    "OPTCLIP_TEST_JAX_CACHE", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                           ".jax_cache")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

settings.register_profile(
    "ci", max_examples=20, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def one_device(monkeypatch):
    """The paths a step takes where a single CPU device is visible (as ``make bench`` runs;
    the suite sees 8): variadic reduces shared by same-shape leaves or computed row by row
    (``norms._may_group``), and the top-q ranking by blocks of rows
    (``slices.single_cpu_device``)."""
    from optclip._core import norms, slices
    monkeypatch.setattr(norms, "_may_group", lambda: True)
    monkeypatch.setattr(slices, "single_cpu_device", lambda: True)
