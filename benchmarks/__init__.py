"""The benchmark, a tool of the repository (not installed): ``python -m benchmarks --help``.

Bottom to top: ``machine`` (the machine's facts, read once by the parent), ``cli`` (flags and
per-device defaults), ``runner`` (process supervisor, per-rank worker, timing and inputs), the
sections ``ceilings``, ``kernels``, ``dispatchers`` (Megatron) and ``team`` (EP>1 as a local team
on one GPU), ``sweeps``, then ``report`` (floors, each section's rows, table, JSON,
``source_version``), ``markdown`` and ``plot``; ``__main__`` runs them in order.
"""

from .report import source_version

__all__ = ["source_version"]
