"""Alpha-beta communication cost models: pure functions of bytes and links, returning milliseconds."""

from __future__ import annotations

from collections.abc import Sequence

from cost_models.device_spec import require_count
from cost_models.devices import DeviceSpec, LinkSpec
from cost_models.errors import InvalidArgument

__all__ = [
    "ALLREDUCE_BUCKET_BYTES",
    "FIRST_BUCKET_BYTES",
    "GATHERS_AHEAD",
    "GATHER_ROW_HELD",
    "KEPT_SUM_TABLE",
    "allreduce_link",
    "overlapped_share",
    "halo_exchange_ms",
    "halo_message_count",
    "hierarchical_allreduce_ms",
    "host_transfer_ms",
    "nvme_transfer_ms",
    "p2p_link",
    "same_node",
    "p2p_ms",
    "p2p_post_ms",
    "ring_allreduce_ms",
    "p2p_coefficients",
    "ring_allreduce_coefficients",
]


ALLREDUCE_BUCKET_BYTES = 25 * 2**20
"""Gradients of one data-parallel all-reduce launch (DDP's default bucket); the runtime fills buckets in
backward order (runtime/grads.py), the first one smaller (``FIRST_BUCKET_BYTES``) so that the all-reduce
starts early in the backward, as DDP's does."""

FIRST_BUCKET_BYTES = 2**20


RECEIVES_POSTED_AHEAD: dict[str, int] = {"nccl": 0, "gloo": 1}  # runs of receives a rank posts before reaching them
"""gloo sends a message from the sender's own thread only when the receiver's irecv is already posted (else
its background thread does, later, competing with the sender's compute): CPU ranks post the next run's
receives with the current run, and hold its buffers that much earlier (runtime/comm.py). NCCL does not: a
posted receive occupies the communication stream and a send behind it that the peer needs first would
deadlock."""


GATHERS_AHEAD: dict[str, bool] = {"nccl": True, "gloo": False}
"""Whether ZeRO-3 plans start each layer group's all-gather while the group before it computes (FSDP's prefetch:
runtime/layer_gathers.py): NCCL runs it on a stream of its own; gloo's threads share the one core of a CPU rank
with its compute (measured on a 3.4M-parameter GPT over 2 CPU ranks: 136.9 ms a step with, 141.3 without, medians
of 4 alternated runs each within the machine's spread), so its plans keep the memory it would take."""


KEPT_SUM_TABLE: dict[str, int] = {"nccl": 0, "gloo": 1}
"""Copies of the largest ZeRO-3 gather group's gradients a rank keeps between its layer sums: none on NCCL (each
reduce-scatter's table is the caching allocator's to reuse); on gloo the table of its in-place all-reduces
(runtime/sharding.py, ShardGroup: a new table each time was sometimes freed on gloo's worker thread, where the CPU
meter does not see it)."""


GATHER_ROW_HELD: dict[str, bool] = {"nccl": True, "gloo": False}
"""Whether a ZeRO-3 all-gather's input (this rank's row of shards) is still held while the weights are filled from
its output: NCCL's process group keeps a collective's tensors until its watchdog sees it complete; on gloo the
runtime waits for the worker thread to let go and drops it first (runtime/sharding.py)."""


ALL_GATHER_STAGING: dict[str, int] = {"nccl": 0, "gloo": 1}  # output-sized buffers an all-gather allocates
"""gloo's ``all_gather_into_tensor`` gathers into a buffer of its own the size of the output, then copies it
out (measured on torch 2.13's CPU build: tests/dist/test_step_memory.py); NCCL writes the output in place."""


ALL_GATHER_SHARE = 0.5
"""What an all-gather (or a reduce-scatter) of a ring costs, as a share of a ring all-reduce of the same bytes: one
of its two passes (n - 1 steps each of 1/n of the bytes)."""


LAYER_REDUCE_SHARE: dict[str, float] = {"nccl": ALL_GATHER_SHARE, "gloo": 1.0}
"""What ZeRO-3's per-layer gradient reduce-scatter costs, as a share of a ring all-reduce of the same bytes: half on
NCCL; on gloo the runtime sums the layer's table with an in-place all-reduce instead (runtime/sharding.py,
ShardGroup: gloo's reduce-scatter's temporary is freed where the CPU meter cannot see it)."""


def hidden_share(grad_bytes: float, backend: str) -> float:
    """Of a data-parallel all-reduce of ``grad_bytes``, the share its last backward hides: DDP's buckets before
    the last (:func:`overlapped_share`), or none on gloo, whose copies and sums take the very core the
    backward runs on (a CPU rank has one to itself)."""
    return 0.0 if backend == "gloo" else overlapped_share(grad_bytes)


def overlapped_share(grad_bytes: float, bucket_bytes: int = ALLREDUCE_BUCKET_BYTES,
                     first_bytes: int = FIRST_BUCKET_BYTES) -> float:
    """Of an all-reduce of ``grad_bytes`` in buckets filled in backward order (the first of ``first_bytes``,
    then of ``bucket_bytes``), the share in the buckets before the last: those start while the last
    backward still computes, the last when it ends.

    >>> overlapped_share(2**19), overlapped_share(11 * 2**20), overlapped_share(61 * 2**20)
    (0.0, 0.09090909090909094, 0.8360655737704918)
    """
    rest = grad_bytes - first_bytes
    if rest <= 0:
        return 0.0
    last = rest % bucket_bytes or bucket_bytes
    return 1.0 - last / grad_bytes


def _alpha_ms(link: LinkSpec) -> float:
    return link.latency_us * 1e-3


def _beta_ms_per_byte(link: LinkSpec) -> float:
    return 1e3 / link.bandwidth_bytes_per_s()


def p2p_coefficients(link: LinkSpec) -> tuple[float, float]:
    """(fixed ms, ms per byte) of one message over `link`: the alpha-beta model as numbers."""
    return _alpha_ms(link), _beta_ms_per_byte(link)


def p2p_post_ms(link: LinkSpec) -> float:
    """What posting one message (one tensor) over `link` costs the posting rank."""
    return link.post_us * 1e-3


def ring_allreduce_coefficients(participants: int, link: LinkSpec) -> tuple[float, float]:
    """(fixed ms, ms per byte) of a ring all-reduce: 2(n-1) alphas and 2(n-1)/n bytes per beta.

    Linear models (the partition ILP) use these; `ring_allreduce_ms` evaluates the same line.
    """
    n = require_count(participants, "participants", minimum=1)
    steps = 2 * (n - 1)
    return steps * _alpha_ms(link), steps / n * _beta_ms_per_byte(link)


def _ring_ms(nbytes: float, participants: int, link: LinkSpec) -> float:
    """Ring all-reduce time for a possibly fractional byte count; callers validate their inputs."""
    if participants == 1 or nbytes == 0:
        return 0.0
    fixed_ms, ms_per_byte = ring_allreduce_coefficients(participants, link)
    return fixed_ms + ms_per_byte * nbytes


def p2p_ms(nbytes: int, link: LinkSpec) -> float:
    """One point-to-point message of `nbytes` over `link`: alpha + nbytes / beta; 0.0 for 0 bytes."""
    return link.transfer_ms(nbytes)


def p2p_link(device: DeviceSpec, same_node: bool) -> LinkSpec:
    """The link a point-to-point transfer uses: NVLink within a node, the NIC share across nodes."""
    return device.intra_node if same_node else device.inter_node


def ring_allreduce_ms(nbytes: int, participants: int, link: LinkSpec) -> float:
    """Ring all-reduce of `nbytes` per participant over `link`.

    A ring reduce-scatter then all-gather takes 2(n-1) steps, each sending nbytes/n to the next
    rank and paying the link latency once:  2(n-1)*alpha + 2(n-1)/n * nbytes / beta.
    0.0 for a single participant or for 0 bytes (no collective is issued).
    """
    count = require_count(nbytes, "nbytes", minimum=0)
    n = require_count(participants, "participants", minimum=1)
    return _ring_ms(float(count), n, link)


def same_node(rank_a: int, rank_b: int, gpus_per_node: int) -> bool:
    """Whether two ranks share a node, ranks being numbered node by node (as torchrun does)."""
    per_node = require_count(gpus_per_node, "gpus_per_node", minimum=1)
    return rank_a // per_node == rank_b // per_node


def allreduce_link(device: DeviceSpec, ranks: Sequence[int], gpus_per_node: int) -> LinkSpec:
    """The bottleneck link of a flat ring over ``ranks``: intra_node if they share one node, else inter_node."""
    if not ranks:
        raise InvalidArgument("an all-reduce needs at least one rank")
    if all(same_node(ranks[0], rank, gpus_per_node) for rank in ranks):
        return _collective(device)
    return device.inter_node


def _collective(device: DeviceSpec) -> LinkSpec:
    """How an all-reduce within a node runs: the measured collective link, else the intra-node link."""
    return device.collective_link or device.intra_node


def hierarchical_allreduce_ms(nbytes: int, participants: int, gpus_per_node: int, device: DeviceSpec) -> float:
    """Two-level all-reduce: ring reduce-scatter in each node, ring all-reduce across nodes, all-gather.

    With N = nbytes, g = gpus_per_node GPUs per node and m = participants / g nodes:

        2(g-1)*alpha_intra + 2(g-1)/g * N / beta_intra        (reduce-scatter + all-gather in a node)
      + 2(m-1)*alpha_inter + 2(m-1)/m * (N/g) / beta_inter    (g concurrent cross-node rings on N/g each)

    Each GPU's cross-node ring runs over its own share of the node's NICs (`inter_node` is per GPU),
    so the g rings proceed in parallel. A group that fits in one node is a flat ring over NVLink.
    `participants` must be a multiple of `gpus_per_node` when it spans several nodes.
    """
    count = require_count(nbytes, "nbytes", minimum=0)
    n = require_count(participants, "participants", minimum=1)
    g = require_count(gpus_per_node, "gpus_per_node", minimum=1)
    if n <= g:
        return _ring_ms(float(count), n, _collective(device))
    if n % g != 0:
        raise InvalidArgument(
            f"participants={n} spans several nodes but is not a multiple of gpus_per_node={g}; "
            f"use whole nodes (e.g. {n // g * g} or {(n // g + 1) * g}) or ring_allreduce_ms with "
            f"allreduce_link for an uneven group"
        )
    intra_ms = _ring_ms(float(count), g, _collective(device))
    inter_ms = _ring_ms(count / g, n // g, device.inter_node)
    return intra_ms + inter_ms


def halo_message_count(bytes_per_neighbour: Sequence[int]) -> int:
    """Messages one rank sends in a halo exchange: one per neighbour with a non-empty halo."""
    return sum(1 for nbytes in _halo_sizes(bytes_per_neighbour) if nbytes > 0)


def halo_exchange_ms(bytes_per_neighbour: Sequence[int], link: LinkSpec) -> float:
    """Time for one rank to exchange halos with all its neighbours over `link`.

    `bytes_per_neighbour[i]` is what this rank sends to (and, symmetrically, receives from)
    neighbour i. Model: the rank issues its k non-empty messages back to back, so the per-message
    latencies serialise, while the payloads share the link's per-direction bandwidth. Sends and
    receives use opposite directions of a full-duplex link and overlap completely:

        k * alpha + sum(bytes_per_neighbour) / beta

    This is pessimistic on latency (a NIC can overlap some issue cost) and exact on bandwidth
    when every neighbour is reached over the same link. 0.0 when there is nothing to send.
    """
    sizes = _halo_sizes(bytes_per_neighbour)
    messages = sum(1 for nbytes in sizes if nbytes > 0)
    if messages == 0:
        return 0.0
    return messages * _alpha_ms(link) + sum(sizes) * _beta_ms_per_byte(link)


def _halo_sizes(bytes_per_neighbour: Sequence[int]) -> list[int]:
    if isinstance(bytes_per_neighbour, (str, bytes)) or not isinstance(bytes_per_neighbour, Sequence):
        raise InvalidArgument(f"bytes_per_neighbour must be a sequence of int byte counts, got {bytes_per_neighbour!r}")
    return [
        require_count(nbytes, f"bytes_per_neighbour[{i}]", minimum=0) for i, nbytes in enumerate(bytes_per_neighbour)
    ]


def host_transfer_ms(nbytes: int, device: DeviceSpec) -> float:
    """One-way copy of `nbytes` between the device and host memory over its PCIe host link (e.g. swap)."""
    return device.host_link.transfer_ms(nbytes)


def nvme_transfer_ms(nbytes: int, device: DeviceSpec) -> float:
    """One-way transfer of `nbytes` between the device's node and its local NVMe drive."""
    return device.nvme.transfer_ms(nbytes)
