"""The plugin's options (``NcclEpOptions``), their ``--nccl-ep-*`` flags, and the process-wide
options both Megatron dispatchers read (``get_options``: ``set_options()``'s, else the flags of
Megatron's parsed training arguments, else the defaults). Imports neither torch nor Megatron at
import time, so that ``python -m megatron_nccl_ep.launch --help`` answers at once."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from .limits import DEFAULT_NUM_SMS, DEFAULT_TIMEOUT_S

BACKENDS = ("auto", "torch", "cuda")
RECV_MODES = ("exact", "capacity")
CAPACITY_OVERFLOWS = ("redo", "error")


@dataclasses.dataclass(frozen=True)
class NcclEpOptions:
    """What the dispatcher needs beyond Megatron's TransformerConfig."""

    backend: str = "auto"  # "auto" | "torch" | "cuda"
    recv_mode: str = "exact"  # "exact" | "capacity"
    # Capacity mode's static budget, factor x the balanced share: rows per rank (factor x tokens
    # per rank x top-k) where the layer's experts read device counts (nccl_ep's grouped
    # experts), else rows per (expert, source rank) (Megatron's get_capacity).
    capacity_factor: float = 2.0
    # Capacity mode in Megatron training, a step in which a layer needed more than its budget:
    # "redo" redoes it (exact mode, eagerly) before the optimizer step and grows the budget for
    # the steps after it (graphs recaptured); "error" raises after the step (check_budgets).
    capacity_overflow: str = "redo"
    num_sms: int = DEFAULT_NUM_SMS
    # SM budget of the inference dispatcher's LL kernels (decode): 0, every SM of the GPU (the
    # LL ops are latency-bound and run alone); the reference backend has no SM budget.
    ll_num_sms: int = 0
    # Tokens per rank the group is sized for. None: from Megatron's training arguments when they
    # are parsed (seq_length x micro_batch_size, divided by the tensor-parallel size under sequence
    # parallelism), else the next power of two of the batch's token count, which needs equal
    # counts on the ranks of an EP group.
    max_tokens_per_rank: Optional[int] = None
    # Ranks per node of the communication group (docs/design.md §4, groups that span nodes): a
    # divisor of the group size; 0: one node (torch backend) / NCCL's LSA team (cuda backend).
    ranks_per_node: int = 0
    # Seconds any rank waits for its peers (group creation's rendezvous, device-side waits)
    # before the group raises NcclEpError naming the ranks not heard from.
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"nccl_ep backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.recv_mode not in RECV_MODES:
            raise ValueError(
                f"nccl_ep recv_mode must be one of {RECV_MODES}, got {self.recv_mode!r}")
        if self.capacity_overflow not in CAPACITY_OVERFLOWS:
            raise ValueError(f"nccl_ep capacity_overflow must be one of {CAPACITY_OVERFLOWS}, got "
                             f"{self.capacity_overflow!r}")
        if not self.capacity_factor > 0:
            raise ValueError(f"nccl_ep capacity_factor must be > 0, got {self.capacity_factor}")
        if self.num_sms < 1:
            raise ValueError(f"nccl_ep num_sms must be >= 1, got {self.num_sms}")
        if self.ll_num_sms < 0:
            raise ValueError(f"nccl_ep ll_num_sms must be >= 0 (0: every SM), got "
                             f"{self.ll_num_sms}")
        if self.max_tokens_per_rank is not None and self.max_tokens_per_rank < 1:
            raise ValueError(
                f"nccl_ep max_tokens_per_rank must be >= 1 or None, got {self.max_tokens_per_rank}")
        if self.ranks_per_node < 0:
            raise ValueError(f"nccl_ep ranks_per_node must be >= 0, got {self.ranks_per_node}")
        if not self.timeout_s > 0:
            raise ValueError(f"nccl_ep timeout_s must be > 0, got {self.timeout_s}")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``--nccl-ep-*`` flags (defaults: ``NcclEpOptions``)."""
    defaults = NcclEpOptions()
    group = parser.add_argument_group(title="nccl_ep token dispatcher")
    group.add_argument("--nccl-ep-backend", choices=BACKENDS, default=defaults.backend,
                       help="cuda: our kernels; torch: the reference; auto: cuda on GPUs where the "
                            "library is built, else torch (default: %(default)s).")
    group.add_argument("--nccl-ep-recv-mode", choices=RECV_MODES, default=defaults.recv_mode,
                       help="exact: receive counts read once per layer (one host sync); "
                            "capacity: fixed-size outputs, no host sync (default: %(default)s).")
    group.add_argument("--nccl-ep-capacity-factor", type=float, default=defaults.capacity_factor,
                       help="capacity mode: the static budget, factor x the balanced share: "
                            "received rows per rank (factor x tokens x top-k) with "
                            "--moe-grouped-gemm, else per expert and source rank (Megatron's "
                            "capacity) (default: %(default)s).")
    group.add_argument("--nccl-ep-capacity-overflow", choices=CAPACITY_OVERFLOWS,
                       default=defaults.capacity_overflow,
                       help="capacity mode, a step that needed more than the budget: redo redoes "
                            "it in exact mode before the optimizer step and grows the budget "
                            "(CUDA graphs recaptured); error raises after the step "
                            "(default: %(default)s).")
    group.add_argument("--nccl-ep-num-sms", type=int, default=defaults.num_sms,
                       help="SM budget of each dispatch/combine kernel (default: %(default)s).")
    group.add_argument("--nccl-ep-ll-num-sms", type=int, default=defaults.ll_num_sms,
                       help="SM budget of each LL kernel of the inference dispatcher (decode; "
                            "0: every SM of the GPU; default: %(default)s).")
    group.add_argument("--nccl-ep-max-tokens-per-rank", type=int,
                       default=defaults.max_tokens_per_rank,
                       help="tokens per rank the groups are sized for; a batch above it raises on "
                            "every rank (default: seq length x micro batch size, divided by the "
                            "tensor-parallel size under sequence parallelism; outside Megatron "
                            "training, the next power of two of each batch's token count, which "
                            "must then be equal on the ranks of an EP group).")
    group.add_argument("--nccl-ep-ranks-per-node", type=int, default=defaults.ranks_per_node,
                       help="ranks per node of the dispatcher's group: tokens cross between "
                            "nodes once per node and the combine sums node by node (0: the "
                            "NVLink domain (cuda backend) / one node (torch backend); default: "
                            "%(default)s).")
    group.add_argument("--nccl-ep-timeout-s", type=float, default=defaults.timeout_s,
                       help="seconds a rank waits for its peers (group creation, device-side "
                            "waits) before raising an error that names the ranks not heard from "
                            "(default: %(default)s).")
    return parser


def options_from_args(args) -> NcclEpOptions:
    """The options in parsed arguments: argparse's namespace, or the namespace Megatron builds
    from ``--yaml-cfg`` (top-level ``nccl_ep_*`` keys; absent ones take the defaults)."""
    return NcclEpOptions(**{field.name: getattr(args, f"nccl_ep_{field.name}", field.default)
                            for field in dataclasses.fields(NcclEpOptions)})


# -- the process-wide options ----------------------------------------------------------------
_global_vars = None  # megatron.training.global_vars once imported; False: not importable


def training_args():
    """Megatron's parsed training arguments, or None outside Megatron training.

    Read where ``get_args()`` reads them (``global_vars._GLOBAL_ARGS``) because Megatron has no
    public getter that answers "not set" without raising (``get_args`` asserts), and every
    forward of every layer asks, outside training (inference, tests) too, where raising and
    catching that assertion each time would cost many times this read."""
    global _global_vars
    if _global_vars is None:
        try:
            from megatron.training import global_vars as _global_vars
        except ImportError:
            _global_vars = False
    if _global_vars is False:
        return None
    return getattr(_global_vars, "_GLOBAL_ARGS", None)


_options: Optional[NcclEpOptions] = None  # set_options()'s; None: never called


def set_options(options: Optional[NcclEpOptions] = None, **fields) -> NcclEpOptions:
    """Sets the process-wide options (over the ``--nccl-ep-*`` flags; a TransformerConfig's
    ``nccl_ep_options`` wins over both). Dispatchers read them at each forward, so set them
    before training starts.

    Args:
        options: a whole ``NcclEpOptions``, or None to change ``fields`` of the current ones.
        fields: ``NcclEpOptions`` fields as keywords.

    Returns:
        The options now in force.
    """
    global _options
    _options = dataclasses.replace(options or get_options(), **fields)
    return _options


_DEFAULT_OPTIONS = NcclEpOptions()
# The options of the last training arguments read: every forward of every layer asks (a per-layer
# host path), and Megatron parses its arguments once.
_args_options: tuple = (None, _DEFAULT_OPTIONS)


def get_options() -> NcclEpOptions:
    """``set_options()``'s, else the ``--nccl-ep-*`` flags of Megatron's parsed training
    arguments (read once per arguments object), else the defaults."""
    global _args_options
    if _options is not None:
        return _options
    args = training_args()
    if args is None:
        return _DEFAULT_OPTIONS
    if _args_options[0] is not args:
        _args_options = (args, options_from_args(args))
    return _args_options[1]
