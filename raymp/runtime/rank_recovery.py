"""The rank side of fault tolerance, in one object the Worker calls: when it joins a world, when
it sets up (where the state comes from), on every step (the commit vote, the abandon check) and
in its step's failure path (a peer lost). torchft's Manager plays the same part for a torchft
replica: the training code asks it, and knows nothing of how groups are left and re-formed.

Why one object: what a rank does about a fault has an order the Worker must not restate (a host
copy of the state before the model goes, the model before the groups, the groups before the next
join), and its pieces (the world's groups, the kept copy, the last vote) change together."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch.distributed as dist

from raymp.runtime.commit_vote import Ballot, StepRecord
from raymp.runtime.kept_state import KeptState
from raymp.runtime.membership import WorldMembership
from raymp.runtime.peer_loss import is_peer_loss

T = TypeVar("T")


class StateParts(NamedTuple):
    """What a rank's host copy is made of, and put back into (rank_state.host_state)."""

    step_runner: Any
    engine: Any
    scheduler: Any


class RankRecovery:
    """This rank's world (WorldMembership), the state it keeps while the world is re-formed
    (KeptState) and the commit vote it took last."""

    def __init__(self):
        self.world = WorldMembership()
        self.kept = KeptState()
        self.rank, self.world_size = 0, 1
        self._last_vote: StepRecord | None = None

    # -- the world --------------------------------------------------------------------------

    def join(self, rank: int, world_size: int, addr: str, port: int, backend: str,
             timeout_s: float) -> dist.ProcessGroup:
        """Form the world at the rendezvous (WorldMembership.join); returns the checkpoint group."""
        self.rank, self.world_size = rank, world_size
        return self.world.join(rank, world_size, addr, port, backend, timeout_s)

    def forming(self) -> contextlib.AbstractContextManager:
        return self.world.forming()

    def mesh(self, layout, device_type: str) -> dict:
        return self.world.mesh(layout, device_type)

    def leave(self) -> None:
        """Leave a world whose groups are whole (the survivors re-form it without a lost peer;
        the model that held the groups went first)."""
        self.world.leave(broken=False)

    # -- set-up -----------------------------------------------------------------------------

    def begin_setup(self, from_memory: bool) -> bool:
        """Where the state of the set-up to come is from, chosen by the driver once: from memory
        (restore() follows: the copy kept here, or one received from a live peer), or not, and
        then any copy kept here is stale and goes. Returns whether the set-up makes initial
        values."""
        if not from_memory:
            self.kept.drop()
        return not from_memory

    def keep(self, parts: StateParts) -> int:
        """A host copy of the state until restore() (KeptState.keep); returns its optimizer steps."""
        return self.kept.keep(*parts)

    def describe_kept(self) -> dict:
        return self.kept.description()

    def restore(self, parts: StateParts, send_to: tuple[int, ...], receive_from: int | None,
                description: dict | None) -> None:
        """The kept copy handed over in the new world (KeptState.hand_over), then put back."""
        self.kept.hand_over(send_to, receive_from, description)
        self.kept.put_back(*parts)

    # -- the step ---------------------------------------------------------------------------

    def abandon(self, formation: tuple[str, int]) -> bool:
        """Drop the running step if `formation` is this world (peer_loss.StepAbandon); called from
        the actor's control thread."""
        return self.world.abandon.request(formation)

    def check_abandoned(self) -> None:
        """Raise StepAbandoned if the driver dropped the running step (at every activation)."""
        self.world.abandon.check()

    def ballot(self, step: int, loss: float | None, sample_ids: np.ndarray | None,
               ids_per_rank: int) -> Ballot:
        """This rank's ballot of `step`, to ride on the step's last collective (commit_vote)."""
        return Ballot(step, loss, sample_ids, ids_per_rank, self.rank, self.world_size)

    def counted(self, ballot: Ballot) -> None:
        """The collective summed the ballots: the vote of its step is every rank's record."""
        self._last_vote = ballot.record()

    def step_record(self, step: int) -> StepRecord | None:
        """What the vote of `step` gathered, if the last vote here was that step's."""
        vote = self._last_vote
        return vote if vote is not None and vote.step == step else None

    def run_step(self, step: Callable[[], T], parts: Callable[[], StateParts],
                 release: Callable[[], None]) -> T:
        """Run `step`. If it fails for a lost peer: keep a host copy of the state (`parts()`: the
        failed step never reached the optimizer, so this is the state to keep), let the caller
        `release()` what holds the process groups (the model, the checkpoint writers), leave
        every group (no call here and no peer waiting on this rank blocks on them,
        raymp.runtime.peer_loss), and raise a DistError that says what was lost. Other errors
        pass as they are. After a loss no step runs until the next join."""
        if self.world.broken:
            raise dist.DistError("this rank left its process group after a peer was lost")
        try:
            return step()
        except Exception as exc:
            if not is_peer_loss(exc):
                raise
            lost = f"{type(exc).__name__}: {exc}"
        # Outside the except block: the error's traceback (which holds the model) is gone.
        self.kept.drop()  # this step's state (it never reached the optimizer) is the one to keep
        self.kept.keep(*parts())
        release()
        self.world.leave(broken=True)
        raise dist.DistError(lost)
