"""Which bundle each rank takes once Ray has placed them: the ranks on one node are consecutive,
so a node holds whole replicas (contiguous rank blocks) and its loss takes as few copies of the
state as it can. No Ray here: Ray's answer (placement_group_table) is given."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from raymp.runtime import placement
from raymp.runtime.placement import Placement


@pytest.fixture
def placed(monkeypatch):
    """pg id -> {bundle index: node}: what Ray's table says for each placement group."""
    tables: dict = {}
    monkeypatch.setattr(placement, "placement_group_table", lambda pg: {"bundles_to_node_id": tables[pg.id]})
    return tables


def pg(tables: dict, pg_id: str, nodes: list[str]):
    tables[pg_id] = dict(enumerate(nodes))
    return SimpleNamespace(id=pg_id, bundle_count=len(nodes))


def test_tp_groups_of_one_replica_are_put_on_one_node(placed):
    """dp2 x pp2 x tp2: Ray put TP groups 0 and 3 on node A, 1 and 2 on node B. Ranks 0-3
    (replica 0) then take A's groups, ranks 4-7 B's."""
    p = Placement({"CPU": 1}, tp_size=2)
    p.pgs = [pg(placed, f"g{i}", [node, node]) for i, node in enumerate("ABBA")]
    slots = p._grouped_by_node([(g, i) for g in p.pgs for i in range(2)])
    assert [s[0].id for s in slots] == ["g0", "g0", "g3", "g3", "g1", "g1", "g2", "g2"]
    assert [s[1] for s in slots] == [0, 1] * 4  # a TP group's ranks keep their bundles' order


def test_bundles_of_one_group_are_taken_node_by_node(placed):
    """Without TP, one PACK group: bundles 0 and 2 on A, 1 and 3 on B."""
    p = Placement({"CPU": 1}, tp_size=1)
    p.pgs = [pg(placed, "g", list("ABAB"))]
    slots = p._grouped_by_node([(p.pgs[0], i) for i in range(4)])
    assert [i for _, i in slots] == [0, 2, 1, 3]


def test_an_order_already_by_node_is_kept(placed):
    p = Placement({"CPU": 1}, tp_size=1)
    p.pgs = [pg(placed, "g", list("AABB"))]
    assert [i for _, i in p._grouped_by_node([(p.pgs[0], i) for i in range(4)])] == [0, 1, 2, 3]
