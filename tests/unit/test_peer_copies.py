"""elastic.peer_copy_every, the rules without Ray: which live node each part of the state is taken
from (none when both copies are gone), and the writer that waits for a copy's write and names the
knob when it runs late. On the session's Ray: integration/test_peer_copies.py."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from raymp.checkpoint.in_memory import PeerCopyWriter
from raymp.elastic.peer_copies import choose_sources, other_node


def test_each_part_is_taken_from_a_live_node_and_none_when_both_copies_are_gone():
    parts, nodes, copies, copy_nodes = ["p0", "p1"], ["A", "B"], ["c0", "c1"], ["B", "A"]
    assert choose_sources(parts, nodes, copies, copy_nodes, {"c0", "c1"}, {"A", "B"}) == ["p0", "p1"]
    assert choose_sources(parts, nodes, copies, copy_nodes, {"c0", "c1"}, {"A"}) == ["p0", "c1"]
    # B's own part is gone and its copy on A was not ready yet: restore from storage.
    assert choose_sources(parts, nodes, copies, copy_nodes, {"c0"}, {"A"}) is None
    assert choose_sources(parts, nodes, copies, copy_nodes, {"c0", "c1"}, set()) is None
    assert [other_node(n, ["B", "A", "C", "A"]) for n in "ABC"] == ["B", "C", "A"]
    assert other_node("A", ["A", "A"]) == "A"
    # A group on one node of several: the copy goes to another node of the cluster.
    assert other_node("A", ["A", "A"], ["C", "A", "B"]) == "B"


def test_the_writer_waits_for_a_copy_s_write_and_names_the_knob_when_it_runs_late(tmp_path):
    """PeerCopyWriter's rules, with its writes stood in for: a DCP call on the checkpoint group
    waits for a copy's write; one past its bound says which copy and which knob; a failed write
    is finish()'s error; every scratch directory goes."""
    writer = PeerCopyWriter(checkpointer=None, timeout_s=0.01)
    writing, failed = Future(), Future()
    failed.set_exception(RuntimeError("disk full"))
    for step, future in ((3, writing), (4, failed)):
        (tmp_path / str(step)).mkdir()
        writer._writes[step] = (str(tmp_path / str(step)), future)
    with pytest.raises(TimeoutError, match=r"peer copy of step 3 was still writing after 0.01s "
                                           r"\(resources.collective_timeout_s\)"):
        writer.wait_written()  # the write never ends: the bound ends the wait
    with pytest.raises(RuntimeError, match="disk full"):
        writer.finish(4)
    assert not (tmp_path / "4").exists() and list(writer._writes) == [3]
    with pytest.raises(RuntimeError, match="no peer copy of step 4 is in flight"):
        writer.finish(4)
    writer.discard()
    assert writer._writes == {} and (tmp_path / "3").exists()  # still being written
    writing.set_result(None)
    assert not (tmp_path / "3").exists()
