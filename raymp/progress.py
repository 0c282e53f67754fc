"""The driver's progress display: a live rich bar on a terminal, plain lines elsewhere (job logs,
notebooks capturing stdout), so `ray job logs` shows progress too."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class StepProgress:
    def __init__(self, total: int, log_every: int, enabled: bool = True):
        self.console = Console(file=sys.stdout)
        if not self.console.is_terminal:  # job logs / pipes: never wrap lines at 80 columns
            self.console = Console(file=sys.stdout, width=1000, soft_wrap=True)
        self.log_every, self.enabled, self.total = log_every, enabled, total
        self.live = enabled and self.console.is_terminal
        self._bar = None
        if self.live:
            self._bar = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"), TimeRemainingColumn(), console=self.console,
            )
            self._task = self._bar.add_task("train", total=total, status="")
            self._bar.start()

    def update(self, m: dict) -> None:
        if not self.enabled:
            return
        step = m["step"] + 1
        status = f"loss {m['loss']:.4f}  {m['tokens_per_s']:,.0f} tok/s"
        if self._bar is not None:
            self._bar.update(self._task, completed=step, status=status)
        if step % self.log_every == 0 or step == self.total or step == 1 or "val_loss" in m:
            val = f"  val_loss {m['val_loss']:.4f}" if m.get("val_loss") is not None else ""
            bubble = ""
            if m.get("bubble_fraction") is not None:
                theory = m.get("bubble_fraction_theory")
                bubble = f"  bubble {m['bubble_fraction']:.0%}" + (
                    f" (theory {theory:.0%})" if theory is not None else ""
                )
            if m.get("moe_imbalance_max") is not None:
                bubble += f"  experts max/mean {m['moe_imbalance_max']:.2f}  aux {m['moe_aux_loss']:.4f}"
            self.console.print(
                f"step {step:>5}/{self.total}  loss {m['loss']:.4f}  grad_norm "
                f"{m['grad_norm']:.3f}  {val}  lr {m['lr']:.2e}  {m['tokens_per_s']:,.0f} tok/s  "
                f"{m['step_time_s'] * 1000:.0f} ms/step  data wait "
                f"{m.get('data_wait_fraction', 0):.0%}{bubble}",
                highlight=False,
            )

    def print(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, highlight=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
