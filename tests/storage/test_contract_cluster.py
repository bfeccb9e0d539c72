"""The contract suite, run once more on the Redis Cluster (3 primaries + 3 replicas).

Every test of ``test_contract`` that takes the ``backend`` fixture runs here with ``backend``
set to the cluster's URL, through both the sync and the async API.
"""

from __future__ import annotations

from typing import Any

import pytest

from .test_contract import *  # noqa: F403

# These inspect the store through a single-node client (TTLs, CLIENT LIST, raw keys); the
# scripts that set what they check are the same on a cluster.
del test_async_context_manager_closes  # noqa: F821
del test_sync_context_manager_closes  # noqa: F821
del test_key_lives_its_longest_window_plus_a_margin  # noqa: F821
del test_a_log_written_by_a_clock_behind_lives_until_its_newest_entry_leaves  # noqa: F821


@pytest.fixture
def backend(cluster: Any) -> str:
    """The shared cluster instead of memory:// and the single servers."""
    return str(cluster.url)
