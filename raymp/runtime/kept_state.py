"""The training state a rank keeps in host memory while its world is re-formed (the survivors
go on, ranks join in the places of lost ones), and handing it to the rank that takes the place of
another replica's copy of it (raymp.runtime.transfer)."""

from __future__ import annotations

import json

from raymp.checkpoint.rank_state import host_state, load_host_state
from raymp.runtime.transfer import describe, receive_state, send_state
from raymp.runtime.peer_loss import is_peer_loss


class KeptState:
    """A host copy of this rank's whole training state (model, optimizer, schedule), from when it
    is made until it is put back into the model set up for the new layout."""

    def __init__(self):
        self.copy: dict | None = None

    def keep(self, step_runner, engine, scheduler) -> int:
        """Copy the state to host memory unless a copy is held already: the state until it is put
        back (a rank whose step lost a peer made it as it left its groups; a join that failed left
        its set-up without it). Returns the optimizer steps the copy holds."""
        if self.copy is None:
            self.copy = host_state(step_runner, engine, scheduler)
        return json.loads(self.copy["scheduler"])["last_epoch"]

    def drop(self) -> None:
        self.copy = None

    def description(self) -> dict:
        """What a rank receiving this copy needs to know first (transfer.describe)."""
        return describe(self.copy)

    def hand_over(self, send_to: tuple[int, ...], receive_from: int | None, description: dict | None) -> None:
        """Over the new world's group: send this copy to the joining ranks `send_to`, or receive
        the copy of the live rank `receive_from` (`description`: its description()). A joining
        rank that goes away mid-send fails its own call (a join that failed); this rank goes on
        with the copy it holds."""
        for rank in send_to:
            try:
                send_state(self.copy, rank)
            except Exception as error:
                if not is_peer_loss(error):
                    raise
        if receive_from is not None:
            self.copy = receive_state(description, receive_from)

    def put_back(self, step_runner, engine, scheduler) -> None:
        """Load the copy into the model set up for the new layout; the copy then goes."""
        load_host_state(self.copy, step_runner, engine, scheduler)
        self.copy = None
