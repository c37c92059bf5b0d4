"""The benchmark: ``python -m megatron_nccl_ep.bench --help``.

Bottom to top: ``cli`` (flags and per-device defaults), ``runner`` (process supervisor, per-rank
worker and timing), the sections ``ceilings``, ``kernels``, ``dispatchers`` (Megatron) and
``team`` (EP>1 as a local team on one GPU), ``sweeps``, then ``report`` (floors, table, JSON,
``source_version``), ``markdown`` and ``plot``; ``__main__`` runs them in order.
"""

from .report import source_version

__all__ = ["source_version"]
