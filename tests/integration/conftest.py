"""The integration tier's own 4- and 8-actor groups: they end with the tier, not the session. An
idle rank is not free: each gloo process group it keeps has a thread polling its connections
(~0.1% of a core each, ~3% for a shared rank's ~25 groups), and the system and unit tiers after
this one have no use for them."""

from __future__ import annotations

import pytest

from helpers.groups import shared_group


@pytest.fixture(scope="package")
def group4(ray_local):
    g = shared_group(4)
    yield g
    g.shutdown()


@pytest.fixture(scope="package")
def group8(ray_local):
    g = shared_group(8)
    yield g
    g.shutdown()
