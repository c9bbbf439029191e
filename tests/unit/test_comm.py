"""Unit tests for cost_models.comm: hand-computed alpha-beta times, zero cases and errors."""

from __future__ import annotations

import dataclasses

import pytest

from cost_models.comm import (
    allreduce_link,
    halo_exchange_ms,
    halo_message_count,
    hierarchical_allreduce_ms,
    host_transfer_ms,
    nvme_transfer_ms,
    p2p_link,
    p2p_ms,
    ring_allreduce_ms,
)
from cost_models.devices import PRESETS, DeviceSpec, LinkSpec
from cost_models.errors import InvalidArgument

GB = 10**9
# 10 GB/s, 5 us: beta term is 100 ms per GB, alpha is 0.005 ms.
LINK = LinkSpec("test link", bandwidth_gb_per_s=10.0, latency_us=5.0)


def _device() -> DeviceSpec:
    """A100-40GB with round-number links: NVLink 100 GB/s / 2 us, NIC 10 GB/s / 5 us."""
    return dataclasses.replace(
        PRESETS["A100-40GB"],
        intra_node=LinkSpec("nvlink", bandwidth_gb_per_s=100.0, latency_us=2.0),
        inter_node=LINK,
        host_link=LinkSpec("pcie", bandwidth_gb_per_s=20.0, latency_us=10.0),
        nvme=LinkSpec("nvme", bandwidth_gb_per_s=4.0, latency_us=100.0),
    )


def test_p2p_hand_value() -> None:
    assert p2p_ms(GB, LINK) == pytest.approx(100.005)
    assert p2p_ms(0, LINK) == 0.0
    assert p2p_ms(1, LINK) == pytest.approx(0.005 + 1e-7)


def test_p2p_link_choice() -> None:
    device = _device()
    assert p2p_link(device, same_node=True) is device.intra_node
    assert p2p_link(device, same_node=False) is device.inter_node


def test_ring_allreduce_hand_value() -> None:
    # 2(n-1) = 6 steps of alpha, 2(n-1)/n = 1.5 times the 100 ms beta term.
    assert ring_allreduce_ms(GB, 4, LINK) == pytest.approx(6 * 0.005 + 1.5 * 100.0)
    assert ring_allreduce_ms(GB, 4, LINK) == pytest.approx(150.03)
    assert ring_allreduce_ms(GB, 2, LINK) == pytest.approx(2 * 0.005 + 1.0 * 100.0)


def test_ring_allreduce_zero_cases() -> None:
    assert ring_allreduce_ms(GB, 1, LINK) == 0.0
    assert ring_allreduce_ms(0, 8, LINK) == 0.0


def test_ring_allreduce_errors() -> None:
    with pytest.raises(InvalidArgument, match=r"participants.*0"):
        ring_allreduce_ms(GB, 0, LINK)
    with pytest.raises(InvalidArgument, match=r"nbytes.*-5"):
        ring_allreduce_ms(-5, 4, LINK)
    with pytest.raises(InvalidArgument, match=r"participants.*int"):
        ring_allreduce_ms(GB, 2.5, LINK)  # type: ignore[arg-type]


def test_allreduce_link_choice() -> None:
    device = _device()
    assert allreduce_link(device, range(8), gpus_per_node=8) is device.intra_node
    assert allreduce_link(device, [5], gpus_per_node=8) is device.intra_node
    assert allreduce_link(device, range(16), gpus_per_node=8) is device.inter_node
    assert allreduce_link(device, range(6, 9), gpus_per_node=8) is device.inter_node  # ranks 6, 7 | 8
    with pytest.raises(InvalidArgument, match=r"gpus_per_node.*0"):
        allreduce_link(device, range(4), gpus_per_node=0)


def test_hierarchical_allreduce_hand_value() -> None:
    device = _device()
    # g = 4 per node, m = 2 nodes, N = 1 GB.
    intra = 2 * 3 * 0.002 + 2 * 3 / 4 * 10.0  # NVLink: 10 ms per GB
    inter = 2 * 1 * 0.005 + 2 * 1 / 2 * (100.0 / 4)  # NIC: 100 ms per GB, on N/g
    assert hierarchical_allreduce_ms(GB, 8, 4, device) == pytest.approx(intra + inter)
    # Within one node it is the flat NVLink ring; one GPU per node it is the flat NIC ring.
    assert hierarchical_allreduce_ms(GB, 4, 8, device) == pytest.approx(ring_allreduce_ms(GB, 4, device.intra_node))
    assert hierarchical_allreduce_ms(GB, 4, 1, device) == pytest.approx(ring_allreduce_ms(GB, 4, LINK))
    # Cheaper than a flat ring bottlenecked on the NIC.
    assert hierarchical_allreduce_ms(GB, 16, 8, device) < ring_allreduce_ms(GB, 16, allreduce_link(device, range(16), 8))
    assert hierarchical_allreduce_ms(0, 16, 8, device) == 0.0


def test_hierarchical_allreduce_needs_whole_nodes() -> None:
    with pytest.raises(InvalidArgument, match=r"participants=12.*gpus_per_node=8.*8 or 16"):
        hierarchical_allreduce_ms(GB, 12, 8, _device())


def test_halo_exchange_hand_value() -> None:
    # 2 messages: 2 alphas, 2 GB total over 10 GB/s.
    assert halo_exchange_ms([GB, GB], LINK) == pytest.approx(2 * 0.005 + 200.0)
    # Empty halos send no message and pay no latency.
    assert halo_exchange_ms([GB, 0, 0], LINK) == pytest.approx(100.005)
    assert halo_message_count([GB, 0, 3]) == 2


def test_halo_exchange_zero_and_errors() -> None:
    assert halo_exchange_ms([], LINK) == 0.0
    assert halo_exchange_ms([0, 0], LINK) == 0.0
    assert halo_message_count([]) == 0
    with pytest.raises(InvalidArgument, match=r"bytes_per_neighbour\[1\].*-1"):
        halo_exchange_ms([4, -1], LINK)
    with pytest.raises(InvalidArgument, match=r"sequence"):
        halo_exchange_ms(1024, LINK)  # type: ignore[arg-type]


def test_host_and_nvme_transfers() -> None:
    device = _device()
    assert host_transfer_ms(GB, device) == pytest.approx(0.010 + 50.0)
    assert nvme_transfer_ms(GB, device) == pytest.approx(0.100 + 250.0)
    assert host_transfer_ms(0, device) == 0.0 and nvme_transfer_ms(0, device) == 0.0
    with pytest.raises(InvalidArgument, match=r"-1"):
        host_transfer_ms(-1, device)
    with pytest.raises(InvalidArgument, match=r"-1"):
        nvme_transfer_ms(-1, device)


def test_preset_links_give_plausible_times() -> None:
    h100 = PRESETS["H100-80GB"]
    # 1 GB over NVLink4 (450 GB/s per direction) takes ~2.2 ms, over the 50 GB/s NDR NIC ~20 ms.
    assert p2p_ms(GB, p2p_link(h100, same_node=True)) == pytest.approx(1000 / 450 + 0.003)
    assert p2p_ms(GB, p2p_link(h100, same_node=False)) == pytest.approx(20.005)


def test_ring_allreduce_coefficients_are_the_same_line() -> None:
    from cost_models.comm import ring_allreduce_coefficients

    link = LinkSpec("l", 10.0, 5.0)
    fixed_ms, ms_per_byte = ring_allreduce_coefficients(4, link)
    assert fixed_ms + ms_per_byte * 10**9 == pytest.approx(ring_allreduce_ms(10**9, 4, link))
