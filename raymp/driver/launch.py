"""Launching a layout: the actor group for it, each rank's part of the model built, the
lineage's newest intact state restored (saved under any layout), the data streams started.
Run at set-up and again after every elastic restart."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from raymp import layout_rules
from raymp.checkpoint.lineage import Lineage
from raymp.checkpoint.restore import SETUP_KNOB, restore_newest_intact
from raymp.checkpoint.store import Checkpoint
from raymp.config import ConfigError, RunConfig, config_from_dict, derived, load_config
from raymp.config.rules import vocab_too_small
from raymp.data import DataPosition
from raymp.driver.feed import DataFeed
from raymp.elastic.peer_copies import PeerCopies
from raymp.models import model_args
from raymp.models.build import model_spec
from raymp.models.masks import document_eot
from raymp.models.shape import model_shape
from raymp.parallel.pipeline import balance_stages
from raymp.planner import estimate
from raymp.runtime.actor_group import ActorGroup
from raymp.runtime.cluster import host_memory_problem
from raymp.runtime.report import RankSetup


def as_config(config: RunConfig | str | Path | dict, overrides: list[str] | None = None) -> RunConfig:
    if isinstance(config, RunConfig):
        return config_from_dict(config.model_dump(mode="json"), overrides) if overrides else config
    if isinstance(config, dict):
        return config_from_dict(config, overrides)
    return load_config(config, overrides)


def with_stage_split(cfg: RunConfig, vocab_size: int) -> RunConfig:
    """`cfg` with parallel.stage_layers decided (balanced by cost) when it pipelines and none was
    given: the config the driver hands its ranks (and records in config.yaml and MLflow)."""
    if cfg.parallel.pp == 1 or cfg.parallel.stage_layers is not None:
        return cfg

    args = model_args(cfg.model, vocab_size)
    if cfg.model.factory is not None:  # a factory module's layer count is its own
        args = dataclasses.replace(args, n_layers=model_shape(cfg.model, vocab_size).n_layers)
    split = [list(stage) for stage in balance_stages(args, cfg.parallel.num_stages)]
    return derived(cfg, {"parallel.stage_layers": split}, "the pipeline's stage split")


@dataclass
class Launched:
    group: ActorGroup
    config: RunConfig  # with the stage split decided
    restored: Checkpoint | None
    setup_info: list[RankSetup]  # per rank
    memory_estimate: list  # the planner's RankEstimate per pipeline stage


@dataclass(frozen=True)
class RunParts:
    """What every launch of a run shares, made once at set-up (Trainer.setup): the Launcher
    brings actor groups up with them, the Session steps the live group with them."""

    feed: DataFeed
    lineage: Lineage
    device: str
    peer_copies: PeerCopies  # elastic.peer_copy_every
    shared_group: ActorGroup | None = None  # Trainer(actor_group=...): reused, never replaced


@dataclass(frozen=True)
class FromNewest:
    """Where a launch's state comes from, at a start or a restart: the newest intact state (a
    peer copy, else the lineage's newest intact checkpoint, saved under any layout); with none,
    `position` (None: the first step)."""

    position: DataPosition | dict | None = None


@dataclass(frozen=True)
class FromMemory:
    """Where a launch's state comes from when the group's ranks kept theirs in memory
    (Worker.keep_state): that state given back at `position`, the step it holds, with no storage
    read and no initial value made. `joined`: ranks that just started -> the survivor whose copy
    each takes (the same part of the model in another replica), sent over the new process group
    (restore_survivors)."""

    position: DataPosition
    joined: Mapping[int, int] = field(default_factory=dict)


class Launcher:
    """Builds (or reuses) the actor group for a layout and brings it to the run's state."""

    def __init__(self, parts: RunParts, say, *, warn=None, worker_cls: type | None = None, on_event=None):
        """`say` prints progress notes; `warn` what is said whatever the progress setting (a
        damaged checkpoint passed over); `on_event(name, info)`: ActorGroup's ("placed")."""
        self.feed, self.lineage, self.device = parts.feed, parts.lineage, parts.device
        self.peer_copies, self.shared_group = parts.peer_copies, parts.shared_group
        self.say, self.warn, self.worker_cls, self.on_event = say, warn or say, worker_cls, on_event

    def group_for(self, cfg: RunConfig) -> ActorGroup:
        lay, r = cfg.parallel.layout, cfg.resources
        if self.shared_group is not None:
            if self.shared_group.world_size != lay.world_size:
                raise ValueError(f"the actor group given has {self.shared_group.world_size} actors but the "
                                 f"layout needs dp*cp*pp*tp = {lay.world_size}")
            if cfg.elastic.spares:
                raise ValueError("elastic.spares starts spare actors beside the run's own group, and this "
                                 "run was given a group to share; set elastic.spares=0 or give no group")
            self.shared_group.check_tp_groups_share_nodes(lay.tp)
            return self.shared_group
        return ActorGroup(
            lay.world_size,
            self.device,
            r.cpus_per_actor,
            r.placement_timeout_s,
            r.collective_timeout_s,
            tp_size=lay.tp,
            rendezvous_timeout_s=r.rendezvous_timeout_s,
            on_event=self.on_event,
            spares=cfg.elastic.spares,
            **({"worker_cls": self.worker_cls} if self.worker_cls else {}),
        )

    def launch(self, cfg: RunConfig, start: FromNewest | FromMemory,
               group: ActorGroup | None = None) -> Launched:
        """Ranks set up for `cfg` (on `group`, rejoined survivors, or new actors) and brought to
        the state `start` says (FromNewest or FromMemory); streams started."""
        feed = self.feed
        vocab = feed.data.vocab_size
        # The layout against the tokenizer's real vocabulary (config validation may not have known it).
        layout_rules.check(cfg.parallel.layout, model_shape(cfg.model, vocab, feed.data.tokenizer),
                           cfg.train.global_batch_size, cfg.train.seq_len)
        cfg = with_stage_split(cfg, vocab)
        lay, r = cfg.parallel.layout, cfg.resources
        memory = estimate(model_args(cfg.model, vocab), lay, cfg.train.global_batch_size, cfg.train.seq_len,
                          cfg.bf16)
        if self.device == "cpu" and (problem := host_memory_problem([memory[lay.coords(r)["pp"]].total_bytes
                                                                     for r in range(lay.world_size)])):
            raise ConfigError(problem)
        new_group = group is None
        group = group or self.group_for(cfg)
        from_memory = isinstance(start, FromMemory)

        def set_up():
            # The validated config itself: the ranks do not validate it again.
            return group.call("setup", cfg, vocab, document_eot(cfg, feed.data), from_memory,
                              timeout_s=r.setup_timeout_s, knob=SETUP_KNOB)

        restored = None
        if from_memory:
            # The position is known: the streams start first, and Ray Data's start-up (its executor,
            # the first task) overlaps the set-up instead of adding to the survivors' recovery.
            feed.start_streams(group, lay, cfg, feed.checked(start.position, cfg.train.steps), wait=False)
            infos = set_up()
            restore_survivors(group, start.joined, r.setup_timeout_s)
        else:
            infos = set_up()
            on_disk = self.lineage.candidates()
            restored = (self.peer_copies.restore(group, on_disk[0].step if on_disk else None, set_up)
                        or restore_newest_intact(group, on_disk, set_up, self.warn, r.setup_timeout_s))
            position = restored.data_position if restored is not None else start.position
            first = feed.checked(position, cfg.train.steps) if position is not None else feed.first_position()
            feed.start_streams(group, lay, cfg, first, wait=False)
        if new_group and group.spares and (unplaced := group.spares.unplaced()):
            each = ", ".join(f"{k}={v:g}" for k, v in group.placement.bundle.items())
            self.warn(f"elastic.spares: {unplaced} of {cfg.elastic.spares} spare ranks have no room on the "
                      f"cluster yet ({each} each); the run goes on and starts them when room appears")
        feed.send_eval_data(group, lay, cfg)
        feed.wait_streams(group, r.setup_timeout_s, SETUP_KNOB)
        return Launched(group, cfg, restored, infos, memory)


def restore_survivors(group: ActorGroup, joined: Mapping[int, int], timeout_s: float) -> None:
    """Every rank's kept state back in place; a joined rank first receives its source's copy,
    which the source sends over the new process group before it restores its own
    (Worker.restore_kept, raymp.runtime.transfer). One call per rank, in rank order, so a
    failure names the rank it happened on."""
    takers: dict[int, list[int]] = {}
    for rank, source in joined.items():
        takers.setdefault(source, []).append(rank)
    described = {source: group.workers[source].describe_kept.remote() for source in takers}
    group.collect([w.restore_kept.remote(tuple(takers.get(rank, ())), joined.get(rank),
                                         described.get(joined.get(rank)))
                   for rank, w in enumerate(group.workers)], timeout_s, SETUP_KNOB)


def num_params(cfg: RunConfig, vocab_size: int) -> int:
    return model_spec(cfg.model, vocab_size, cfg.seed).num_params()


def check_vocab(cfg: RunConfig, feed: DataFeed) -> None:
    if problem := vocab_too_small(cfg.model.vocab_size, feed.data.tokenizer, feed.data.vocab_size):
        raise ConfigError(problem)
