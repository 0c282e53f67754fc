"""The depth of the tiny model the layout and fault tests train."""

from __future__ import annotations

from raymp.config.schema import ParallelConfig


def at_fewest_layers(cfg: dict) -> dict:
    """The tiny preset cut to the fewest layers its pipeline takes (2, or one per stage) unless the
    test set a depth or stage_layers itself. A step of this model is per-op overhead in proportion
    to its layers (~2,500 aten ops per micro-batch of the preset's 4 layers, ~26 ms on the 2-core
    machine): two still stack blocks and take about half of a tp2 rank's step time (0.45 s, not
    0.85). MoE and Hugging Face models keep their depth."""
    model, parallel = cfg["model"], cfg.get("parallel", {})
    if not isinstance(parallel, dict):  # parallel: auto, the planner's to choose
        return cfg
    if model.get("preset") == "tiny" and "n_layers" not in model and "stage_layers" not in parallel:
        try:
            stages = ParallelConfig(**parallel).layout.num_stages
        except ValueError:  # a bad layout the test means to be refused: left as it came
            return cfg
        model["n_layers"] = max(2, stages)
    return cfg
