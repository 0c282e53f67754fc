"""Parallelism applied to plain models from outside: data parallel / ZeRO, pipelines, tensor
parallel plans, activation checkpointing. The layout itself is raymp.layout;
its device meshes are parallel.mesh."""
