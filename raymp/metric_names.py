"""The names raymp's metrics have in MLflow. MLflow's chart view makes one collapsible section per
prefix before a "/", sections in alphabetical order (metrics without a prefix come after them, in
"Model metrics", then MLflow's "System metrics"), and titles each chart with the whole name, which
its cards cut at about 13 characters. So the sections are fit (the training curves: first),
mem, moe, pipe, restart and speed, and the names are short. A run's history (Trainer.fit, the
progress line) keeps the keys on the left.
"""

from __future__ import annotations

# Logged every step (when the step has the value).
PER_STEP = {
    "loss": "fit/loss",
    "val_loss": "fit/val_loss",
    "grad_norm": "fit/grad_norm",
    "lr": "fit/lr",
    "update_skipped": "fit/skipped",
    "tokens_per_s": "speed/tok_s",
    "step_time_s": "speed/step_s",
    "model_tflops_per_device": "speed/tflops",
    "mfu": "speed/mfu",
    "data_wait_s": "speed/data_s",
    "data_wait_fraction": "speed/data_frac",
    "checkpoint_blocked_s": "speed/ckpt_s",
    "straggler_ratio": "speed/straggler",
    "bubble_fraction": "pipe/bubble",
    "bubble_fraction_theory": "pipe/theory",
    "restarts": "restart/count",
    "moe_aux_loss": "moe/aux_loss",
    "moe_imbalance_max": "moe/imbalance",
    "moe_dropped_tokens": "moe/dropped",
    "moe_all_to_all_s": "moe/a2a_s",
}
LOSS = PER_STEP["loss"]
VAL_LOSS = PER_STEP["val_loss"]
TOKENS_PER_S = PER_STEP["tokens_per_s"]

# Memory, MiB: the largest rank's peak every step, each rank's peak, and on the steps that
# measure it the measured and the planner's estimate side by side.
PEAK_MEM = "mem/peak_mb"
MEASURED_MEM = "mem/measured"
ESTIMATED_MEM = "mem/estimate"


def rank_peak_mem(rank: int) -> str:
    return f"mem/rank{rank}_mb"


# Once per restart (at the step training resumed from) and once at the end of a run.
RESTART_NUMBER = "restart/number"
ELASTIC_DP = "restart/dp"
RESTART_S = "restart/s"
TOKENS_PER_S_MEDIAN = "speed/tok_s_med"
