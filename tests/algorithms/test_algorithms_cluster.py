"""The algorithm scenarios, run once more on the Redis Cluster (3 primaries + 3 replicas).

Every test of ``test_algorithms`` that takes the ``backend`` fixture runs here with ``backend``
set to the cluster's URL, through both the sync and the async API.
"""

from __future__ import annotations

from typing import Any

import pytest

from .test_algorithms import *  # noqa: F403

# These inspect the store through a single-node client (TTLs, CLIENT LIST, raw keys); the
# scripts that set what they check are the same on a cluster.
del test_concurrency_cost  # noqa: F821
del test_concurrency_key_has_the_documented_ttl  # noqa: F821
del test_cost_above_capacity_never_passes_and_writes_nothing  # noqa: F821
del test_every_key_written_has_the_documented_ttl  # noqa: F821
del test_fixed_window_ttl_ends_with_the_window  # noqa: F821


@pytest.fixture
def backend(cluster: Any) -> str:
    """The shared cluster instead of memory:// and the single servers."""
    return str(cluster.url)
