"""The elastic controller's decisions: what to do about a failure (RecoveryPolicy) and the dp
to go on with or grow back to (ScalingPolicy)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from raymp.config.rules import keeps_survivors
from raymp.elastic.capacity import capacity, largest_valid_dp, largest_valid_replicas, wait_for_replicas
from raymp.elastic.states import Joining, Recovering


class Action(str, Enum):
    KEEP_SURVIVORS = "keep survivors"
    RESTORE = "restore"
    GIVE_UP = "give up"


class RecoveryPolicy:
    """What to do about a failure. Up to elastic.max_restarts failures are recovered from; the
    survivors go on with their state (config.rules.keeps_survivors: by default wherever the layout
    leaves them a copy of it; elastic.keep_survivors=false turns it off) when the rank was lost
    while training or while new ranks joined, the group is still up, and it did not hang (a hung
    rank may not answer the survivors' calls); otherwise the run is restored from the lineage."""

    def __init__(self, elastic, group_is_shared: bool):
        self.enabled, self.max_restarts, self.group_is_shared = (
            elastic.enabled,
            elastic.max_restarts,
            group_is_shared,
        )

    def refusal(self) -> str | None:
        """Why this run recovers from nothing (it then stops at its first failure), or None."""
        if not self.enabled:
            return "elastic.enabled is false"
        if self.group_is_shared:
            return "the actor group was passed in (Trainer(actor_group=...)), so the driver cannot replace it"
        return None

    def replacement_refusal(self, history: list[dict]) -> str | None:
        """Why a straggler is not replaced now (elastic.replace_stragglers), or None: its
        replacement is a failure to recover from, within elastic.max_restarts."""
        if why := self.refusal():
            return why
        if len(history) >= self.max_restarts:
            return (f"the run has recovered from {len(history)} of elastic.max_restarts="
                    f"{self.max_restarts} failures")
        return None

    def decide(self, state: Recovering, history: list[dict], config, group_alive: bool) -> Action:
        """`history`: every failure of the run so far, this one included."""
        if len(history) > self.max_restarts:
            return Action.GIVE_UP
        if (state.during in (None, Joining.name) and keeps_survivors(config) and group_alive
                and state.failure.kind != "timeout"):
            return Action.KEEP_SURVIVORS
        return Action.RESTORE

    def survivors(self, config, kept: dict[int, int], at: int, finished: set[int],
                  spares: int = 0) -> GoOn | Reload | Refuse:
        """What the live ranks can do with what they hold (`kept`: rank -> the steps its state
        holds; the run is at step `at`; `finished`: the ranks whose call of step `at` ended well;
        `spares`: warm spare ranks ready to join, whole TP groups).
        They go on when whole copies of the state among them give a valid dp and all hold step
        `at`, or all took step `at` whole (a rank lost after the step's commit vote leaves every
        rank with the step applied, raymp.runtime.commit_vote, and the run counts it done:
        GoOn.took_step); ready spares (whole copies of them) take the lost copies' places, up to
        the copies the run had. A survivor that holds the step without its call having ended (a fault
        after its optimizer step) or survivors that disagree cannot go on; peer copies
        (elastic.peer_copy_every) then let the whole TP groups among them reload it, with spares
        in the places of the lost ones up to the dp the run had; else the run restores."""
        layout = config.parallel.layout
        held = sorted(set(kept.values()))
        took = held == [at + 1] and set(kept) <= finished
        replicas = layout.whole_replicas(kept)
        room = min(layout.state_replicas, len(replicas) + spares // layout.ranks_per_copy)
        n = largest_valid_replicas(config, room) if replicas and (held == [at] or took) else None
        if n is not None:
            own = min(n, len(replicas))  # the copies the survivors hold; spares join as the rest
            return GoOn([r for ranks in replicas[:own] for r in ranks], n, took,
                        (n - own) * layout.ranks_per_copy)
        if held == [at] or took:
            why = ("no whole copy of the state survived" if not replicas else
                   f"{len(replicas)} whole copies of the state split the global batch into no valid dp")
        else:
            unfinished = sorted(set(kept) - finished) if held == [at + 1] else []
            why = f"their states are after steps {held}, the run is at step {at}" + (
                f" and ranks {unfinished} did not end it" if unfinished else "")
        per = layout.world_size // layout.dp  # the ranks of one dp replica
        ranks = layout.whole_tp_groups(sorted(kept))
        room = min(layout.dp, (len(ranks) + spares) // per)
        dp = largest_valid_dp(config, room) if config.elastic.peer_copy_every and room else None
        if dp is None:
            return Refuse(why)
        joining = max(0, dp * per - len(ranks))
        return Reload(ranks[:dp * per - joining], dp, why, joining)


@dataclass(frozen=True)
class GoOn:
    """The survivors go on with the state they hold: `ranks`, and `spares` warm spare ranks after
    them that take copies of it from them, `replicas` whole copies in all; `took_step`: they all
    took the failed step, which counts as done."""

    ranks: list[int]
    replicas: int
    took_step: bool = False
    spares: int = 0


@dataclass(frozen=True)
class Reload:
    """The survivors cannot keep their state (`why`), but peer copies hold every part of it:
    `ranks` (whole TP groups) and `spares` warm spare ranks after them go on as `dp` replicas,
    every rank reloading the copy (the survivors in their processes)."""

    ranks: list[int]
    dp: int
    why: str
    spares: int = 0


@dataclass(frozen=True)
class Refuse:
    """The survivors cannot go on (`why`): the run restores from the lineage."""

    why: str


class ScalingPolicy:
    """dp after a failure: the largest the live nodes hold now (pp x tp kept, the global batch
    kept); back to the configured dp at a checkpoint once the cluster has room again."""

    def __init__(self, target, device: str, reserve_node: str | None, grow_back: bool):
        """`target`: the configured Layout."""
        self.target_dp, self.target_replicas = target.dp, target.state_replicas
        self.device, self.reserve_node, self.grow_back = device, reserve_node, grow_back

    def after_failure(self, cfg, log) -> tuple[int, float]:
        dp, waited, _ = wait_for_replicas(cfg, self.target_dp, self.device, self.reserve_node, log)
        return dp, waited

    def may_join(self, cfg) -> bool:
        """Cheap: whether the run holds fewer copies of the state than configured and may grow back."""
        return self.grow_back and cfg.parallel.layout.state_replicas < self.target_replicas

    def replicas_to_join(self, cfg, free_replicas: int) -> int | None:
        """More whole copies of the state than now, up to the configured count, that the free
        bundles hold and the global batch splits into; None if none."""
        now = cfg.parallel.layout.state_replicas
        if not self.may_join(cfg) or not free_replicas:
            return None
        n = largest_valid_replicas(cfg, min(now + free_replicas, self.target_replicas))
        return n if n is not None and n > now else None

    def grow_to(self, cfg) -> int | None:
        """A larger dp the cluster holds now, or None."""
        if not self.grow_back or cfg.parallel.dp >= self.target_dp:
            return None
        cap = capacity(cfg, self.device, self.reserve_node, cfg.data.stream_cpus)
        dp = largest_valid_dp(cfg, min(cap.replicas, self.target_dp))
        return dp if dp is not None and dp > cfg.parallel.dp else None
