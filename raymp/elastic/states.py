"""The elastic controller's states (each carries its data) and the event a restart ends in.
The transitions between them are drawn in controller.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, TypedDict

from raymp.layout import LayoutRecord
from raymp.runtime.rank_calls import WorkerLostError


@dataclass(frozen=True)
class Running:
    """Training. `after`: the restart that brought the run back here (None at the start)."""

    after: RestartEvent | None = None
    name: ClassVar[str] = "running"


@dataclass(frozen=True)
class Recovering:
    """A rank was lost; the policy decides next. `during`: the state it was lost in (None:
    while training)."""

    failure: WorkerLostError
    during: str | None = None
    name: ClassVar[str] = "recovering"


@dataclass(frozen=True)
class KeepingSurvivors:
    """The live ranks keep their state in memory and, where whole copies of it survived, go on."""

    failure: WorkerLostError
    name: ClassVar[str] = "keeping survivors"


@dataclass(frozen=True)
class ReloadingSurvivors:
    """No whole copy survived but peer copies hold every part: `ranks` and `spares` warm spare
    ranks after them go on as `dp` replicas, set up anew and restored (`why`: why the survivors
    could not keep their state)."""

    failure: WorkerLostError
    ranks: list[int]
    dp: int
    why: str
    spares: int = 0
    name: ClassVar[str] = "reloading survivors"


@dataclass(frozen=True)
class Restoring:
    """Tear down and relaunch `dp` replicas (None: what the cluster holds) from the lineage's
    newest intact state. `reason`: failure or nonfinite; `refused`: why survivors could not go on."""

    reason: str
    failure: WorkerLostError | None = None
    dp: int | None = None
    refused: str | None = None
    name: ClassVar[str] = "restoring"


@dataclass(frozen=True)
class Resizing:
    """Relaunch larger (`dp`) from the checkpoint just committed."""

    dp: int
    name: ClassVar[str] = "resizing"


@dataclass(frozen=True)
class Joining:
    """`replicas` whole copies of the state, counting the live ones, once new ranks joined."""

    replicas: int
    name: ClassVar[str] = "joining"


@dataclass(frozen=True)
class Failed:
    error: BaseException
    name: ClassVar[str] = "failed"


State = Running | Recovering | KeepingSurvivors | ReloadingSurvivors | Restoring | Resizing | Joining | Failed


class RestartEvent(TypedDict, total=False):
    """What one restart did (logged to MLflow as JSON, kept in Trainer.restarts)."""

    reason: str  # failure | nonfinite | grow
    recovery: str  # survivors | survivors reloaded | restart | live join
    failed_step: int | None
    kind: str | None
    message: str | None
    checkpoint_in_flight: int | None
    checkpoint_in_flight_committed: bool
    layout_before: LayoutRecord
    layout_after: LayoutRecord
    resumed_step: int
    checkpoint: str | None
    wait_for_resources_s: float
    relaunch_s: float
    pids: list[int]
    survivors_refused: str | None
    detected_at: float
    attempts: int
    restart_s: float
