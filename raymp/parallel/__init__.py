"""Parallelism applied to plain models from outside: mesh, data parallel / ZeRO, checkpointing."""

from raymp.parallel.mesh import ParallelDims

__all__ = ["ParallelDims"]
