"""The data feed: the run's dataset and sample order, where a run is in them after a given step
(the run counts its steps: driver.session), and what each rank reads (one Ray Data stream per
first-stage rank, the held-out batches for validation)."""

from __future__ import annotations

from raymp.config import ConfigError, RunConfig
from raymp.data import DataPosition, TrainOrder, load_dataset, replica_slice
from raymp.data.ray_context import (
    local_node_if_local_path,
    free_cpus,
    offers_no_cpu,
    place_ray_data_services_here,
)
from raymp.data.stream import StreamSpec
from raymp.layout import Layout


class DataFeed:
    def __init__(self, cfg: RunConfig, log):
        self.data = load_dataset(
            cfg.data, cfg.train.seq_len, log=log, cpu_wait_s=cfg.resources.placement_timeout_s
        )
        self.order = TrainOrder(
            self.data.num_samples, cfg.data.val_fraction, cfg.seed, cfg.train.global_batch_size
        )
        self.seed = cfg.seed
        self.start: DataPosition | None = None  # where the streams started
        self.eval_batches = 0
        self._services_placed = False  # place_ray_data_services_here, before the first streams

    @property
    def node(self) -> str | None:
        """The node whose disk holds the data, when it is a local path (tasks reading it run there)."""
        return local_node_if_local_path(self.data.root)

    def position(self, steps_done: int) -> DataPosition:
        """Where the run is in the data after `steps_done` steps (the run counts them: Session):
        samples consumed, epoch and offset; saved with a checkpoint, continued from under any layout."""
        consumed = self.order.consumed_before(steps_done, self.start)
        return DataPosition.at(steps_done, consumed, self.order, self.seed, self.data.identity)

    def first_position(self) -> DataPosition:
        return DataPosition.at(0, 0, self.order, self.seed, self.data.identity)

    def checked(self, position: DataPosition | dict, steps: int) -> DataPosition:
        """`position` if this dataset and order can continue from it within `steps` steps."""
        if isinstance(position, dict):
            position = DataPosition.from_dict(position)
        position.check_compatible(self.order, self.seed, self.data.identity)
        if position.step > steps:
            raise ValueError(f"the data position is at step {position.step}, past train.steps={steps}; "
                             "raise train.steps to train on")
        return position

    def start_streams(
        self, group, layout: Layout, cfg: RunConfig, start: DataPosition, wait: bool = True
    ) -> None:
        """One Ray Data stream per first-stage rank (each TP rank of the first stage reads its
        replica's stream), beginning at `start`. `wait`: return once every first batch is in
        (else wait_streams() does: the ranks' next calls run while Ray Data starts)."""
        node = self.node
        cpus = 0 if offers_no_cpu(node) else cfg.data.stream_cpus  # see offers_no_cpu
        free = free_cpus(node)
        if free < cpus:
            where = "the driver's node (data.cache_dir is a local path there)" if node else "the cluster"
            raise ConfigError(
                f"the data streams' Ray Data tasks need data.stream_cpus={cfg.data.stream_cpus} free CPU, "
                f"but {where} has {free:g} left after placing the actors; add CPUs, lower "
                "resources.cpus_per_actor or data.stream_cpus"
                + (", or put data.cache_dir on storage every node reads (s3://, gs://, file:// on a shared "
                   "mount)" if node else ""))
        if not self._services_placed:
            place_ray_data_services_here()
            self._services_placed = True
        steps = cfg.train.steps - start.step
        args = []
        for rank in range(layout.world_size):
            c = layout.coords(rank)
            spec = None
            if c["pp"] == 0 and steps > 0:
                spec = StreamSpec(
                    self.data.root,
                    self.data.num_samples,
                    self.data.seq_len,
                    cfg.data.val_fraction,
                    cfg.seed,
                    cfg.train.global_batch_size,
                    layout.local_batch(cfg.train.global_batch_size),
                    c["dp"],
                    start,
                    node,
                )
            args.append((spec, steps, cpus, cfg.data.prefetch_batches, wait))
        group.call_per_rank("start_stream", args)
        self.start = start

    def wait_streams(self, group, timeout_s: float, knob: str) -> None:
        group.call("wait_stream", timeout_s=timeout_s, knob=knob)

    def send_eval_data(self, group, layout: Layout, cfg: RunConfig) -> None:
        """The held-out batches every validation uses: the first train.eval_batches global
        batches of the validation split, each replica its slice."""
        t = cfg.train
        n = min(t.eval_batches, len(self.order.val_ids) // t.global_batch_size)
        if t.eval_batches and n == 0:
            raise ConfigError(
                f"data.val_fraction={cfg.data.val_fraction} holds out {len(self.order.val_ids)} samples, "
                f"fewer than one global batch ({t.global_batch_size}); raise data.val_fraction or set "
                "train.eval_batches=0")
        self.eval_batches = n
        batches = [
            self.order.val_ids[i * t.global_batch_size : (i + 1) * t.global_batch_size] for i in range(n)
        ]
        args, rows = [], layout.local_batch(t.global_batch_size)
        for rank in range(layout.world_size):
            c = layout.coords(rank)
            if c["pp"] == 0:
                args.append(([self.data.gather(replica_slice(b, rows, c["dp"])) for b in batches],))
            else:
                args.append(([None] * n,))
        group.call_per_rank("set_eval_data", args)

    def eval_due(self, step: int, t) -> bool:
        """Whether a validation follows step `step` (0-based): every train.eval_every steps and
        after the last, when there are held-out batches."""
        return bool(self.eval_batches) and (
            (t.eval_every and (step + 1) % t.eval_every == 0) or step + 1 == t.steps
        )

    def params(self) -> dict:
        """The dataset as MLflow params."""
        m = self.data.manifest
        params = {
            "data.root": self.data.root,
            "data.samples": m["samples"],
            "data.tokens": m["tokens"],
            "data.train_samples": len(self.order.train_ids),
            "data.val_samples": len(self.order.val_ids),
        }
        params.update({f"data.skipped.{reason}": n for reason, n in m["skipped"].items()})
        return params
