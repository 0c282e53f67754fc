"""Which ranks a live run has, and changing them without a restart: the survivors of a loss keep
their state and go on (with warm spares in the lost places), or set up anew and reload a peer
copy; lost replicas join back from live peers; a straggler's process is stopped. The elastic
controller decides which (ElasticController); this carries it out on the session's group. A
restart from storage is the session's (Session.relaunch)."""

from __future__ import annotations

from raymp.checkpoint.restore import COLLECTIVE_KNOB
from raymp.checkpoint.store import Checkpoint
from raymp.config import ConfigError, RunConfig
from raymp.driver.launch import FromMemory, FromNewest
from raymp.driver.session import Session
from raymp.elastic import with_replicas
from raymp.runtime.rank_calls import JoinFailed, WorkerLostError


class RankChanges:
    def __init__(self, session: Session):
        self.session = session

    def keep_survivors(self, lost_rank: int | None) -> dict[int, int]:
        """Every live rank drops its failed step at once (abandon_steps) and copies its state to
        host memory: rank -> optimizer steps its state holds. The lost rank's replica can no
        longer go on: its other ranks are let go at once, so none of their peers waits on them."""
        s = self.session
        s.calls.failed.add_unread(s.group.abandon_steps())
        layout = s.config.parallel.layout
        if lost_rank is not None and layout.state_replicas > 1:  # else: the whole group
            s.group.kill_ranks(layout.replica_of(lost_rank))
        kept = s.group.survivors("keep_state", s.config.resources.collective_timeout_s, COLLECTIVE_KNOB,
                                 s.config.elastic.survivor_grace_s, "elastic.survivor_grace_s")
        s.calls.failed.read_results()
        return kept

    def continue_with_kept_state(self, ranks: list[int], config: RunConfig, spares: int = 0) -> list[int]:
        """The run again on the live `ranks` (same processes, in order) and `spares` warm spare
        ranks after them, with `config`'s layout and the state the live ranks kept in memory
        (whole copies of it, elastic.with_replicas), from the step it holds; each spare takes the
        copy of the rank in its place of replica 0. No storage read. Returns the ranks' process
        ids. A loss while spares join costs the kept ranks nothing: JoinFailed, the group back to
        them alone."""
        s, lay = self.session, config.parallel.layout
        joined = {rank: lay.copy_source(rank) for rank in range(len(ranks), len(ranks) + spares)}
        try:
            self._on_ranks(ranks, config, spares, FromMemory(s.position(), joined))
        except WorkerLostError as error:
            if spares and (alone := _alone(config, len(ranks))):
                # A loss while spares joined: the group goes back to the survivors, who still hold
                # their state (Worker.keep_state); the next keep_survivors finds which are alive.
                s.group.forget_joined(len(ranks))
                s.config = alone
                raise _join_failed(error) from error
            s.shut_down()
            raise
        return [n["pid"] for n in s.group.nodes]

    def continue_with_reloaded_state(self, ranks: list[int], config: RunConfig,
                                     spares: int = 0) -> tuple[Checkpoint | None, list[int]]:
        """The run again on the live `ranks` (same processes, in order) and `spares` warm spare
        ranks after them, with `config`'s layout, set up anew and restored like a restart (a
        peer copy, else the lineage). Returns (what was restored, the ranks' process ids)."""
        s = self.session
        try:
            restored = self._on_ranks(ranks, config, spares, FromNewest(s.initial_position))
        except WorkerLostError:
            s.shut_down()  # a fault while re-forming: the restart path starts from nothing
            raise
        return restored, [n["pid"] for n in s.group.nodes]

    def _on_ranks(self, ranks: list[int], config: RunConfig, spares: int,
                  start: FromNewest | FromMemory) -> Checkpoint | None:
        """The group shrunk to `ranks` plus `spares`, launched with `config` from `start`. On
        any error but a lost rank (the callers' to handle) the group is shut down."""
        s = self.session
        r, group = s.config.resources, s.group
        s.calls.drop_queued()
        try:
            group.shrink_to(ranks, r.collective_timeout_s, r.rendezvous_timeout_s, add=spares)
            s.config = config
            restored = s.launch(start, group)
        except BaseException as error:
            s.group = group  # launch let go of it
            if not isinstance(error, WorkerLostError):
                s.shut_down()
            raise
        return restored

    def join_live(self, replicas: int) -> list[int]:
        """`replicas` whole copies of the state (more than now) from the next step: new ranks start
        in free bundles and each takes the copy of the rank in its place of replica 0 (the others
        keep theirs). No storage read, no step redone. Returns the kept ranks' process ids."""
        s = self.session
        config = s.config  # put back if the join fails
        group, r, lay = s.group, config.resources, config.parallel.layout
        if s.checkpoints.pending is not None:
            s.checkpoints.finish(group)
        per, before = lay.ranks_per_copy, lay.world_size
        try:
            held = set(group.call("keep_state", timeout_s=r.collective_timeout_s, knob=COLLECTIVE_KNOB))
            if held != {s.global_step}:  # never: every rank ran every step; no join resumes elsewhere
                raise RuntimeError(
                    f"ranks hold states after steps {sorted(held)}, the run is at {s.global_step}")
            group.grow((replicas - lay.state_replicas) * per, r.collective_timeout_s, r.rendezvous_timeout_s)
            s.config = with_replicas(config, replicas)
            joined = {rank: lay.copy_source(rank) for rank in range(before, group.world_size)}
            s.launch(FromMemory(s.position(), joined), group)
            return [n["pid"] for n in group.nodes[:before]]
        except Exception as error:
            # The ranks that were there still hold their state (Worker.keep_state): the joined ones
            # go, and the elastic policy decides as for any loss (the survivors go on, by default).
            group.forget_joined(before)
            s.group, s.config = group, config  # as before the join (launch let go of both)
            if _joining_rank_lost(error, before):  # no rank of the layout the survivors go on in
                raise _join_failed(error) from error
            raise
        except BaseException:
            group.shutdown()  # interrupted: the run stops
            s.group = None
            raise

    def stop_rank(self, rank: int) -> None:
        """Stop one rank's process (a straggler replaced): the next step finds it lost."""
        self.session.group.kill_ranks([rank])

    def ready_spares(self) -> int:
        """Warm spare ranks ready to take lost ranks' places now (elastic.spares)."""
        group = self.session.group
        return group.spares.ready() if group is not None and group.spares else 0

    def has_room_to_join(self) -> bool:
        """Free bundles or warm spares, where ranks could join (cheap: no call to Ray)."""
        return self.session.group is not None and self.session.group.has_room()

    def joinable_replicas(self) -> int:
        """Whole copies of the state that could start now in the group's free bundles."""
        return self.session.group.joinable() // self.session.config.parallel.layout.ranks_per_copy


def _joining_rank_lost(error: Exception, before: int) -> bool:
    """Whether `error` is the loss of a rank that was joining the group (its ranks from `before` on)."""
    return isinstance(error, WorkerLostError) and error.rank is not None and error.rank >= before


def _join_failed(error: WorkerLostError) -> JoinFailed:
    return JoinFailed(f"a rank that was joining: {error}", None, error.kind, error.step)


def _alone(config: RunConfig, ranks: int) -> RunConfig | None:
    """`config` with only the whole copies of the state its first `ranks` ranks hold, if valid."""
    try:
        return with_replicas(config, ranks // config.parallel.layout.ranks_per_copy)
    except ConfigError:
        return None
