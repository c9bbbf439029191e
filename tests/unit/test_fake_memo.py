"""Replaying repeated nodes: the same measurements as measuring them again, and cheap outputs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree

from cost_models import fake_measure
from cost_models.fake_factory import fresh_storage
from cost_models.fake_memo import ReplayedTensor, build_replayed, flatten_values
from examples.models.gpt import gpt
from examples.models.resnet import preact_resnet
from planner import trace


@pytest.mark.parametrize("build, example", [
    (lambda: gpt(hidden=64, layers=4, heads=4, seq_len=32, vocab=300),
     torch.empty(2, 32, dtype=torch.long, device="meta")),
    (lambda: preact_resnet(29), torch.empty(2, 3, 32, 32, device="meta")),
], ids=["gpt", "preact_resnet"])
def test_replayed_nodes_measure_what_measuring_them_again_gives(
        build: Callable[[], nn.Module], example: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every node, replayed ones and those run after them on built ReplayedTensors included."""
    replayed = trace(build(), example)
    monkeypatch.setattr(fake_measure, "node_key", lambda *args: None)  # nothing is memoised
    measured = trace(build(), example)
    assert [node.work for node in replayed] == [node.work for node in measured]
    assert replayed == measured


def test_a_replayed_tensor_builds_the_leaf_fake_tensor_it_stands_for() -> None:
    with FakeTensorMode() as mode:
        storage = fresh_storage(4 * 24)
        replayed = ReplayedTensor((2, 3), (6, 1), 2, torch.float32, torch.device("cpu"), True, storage)
        pair = build_replayed((replayed, 5), mode)
        built = pair[0]
        assert isinstance(built, FakeTensor) and pair[1] == 5
        assert (tuple(built.shape), built.stride(), built.storage_offset()) == ((2, 3), (6, 1), 2)
        assert built.untyped_storage()._cdata == replayed.untyped_storage()._cdata
        assert built.untyped_storage().nbytes() == 96 and built.device == torch.device("cpu")
        assert built.requires_grad and built.is_leaf and not built._is_view()
        assert (built * 2).shape == (2, 3)
        plain = torch.empty(3)
        assert build_replayed((plain,), mode)[0] is plain


def test_flat_values_keep_pytree_order_and_nesting_tells_structures_apart() -> None:
    with FakeTensorMode():
        x, y = torch.empty(2), torch.empty(3)
    leaves, nesting = flatten_values((x, 1), {"other": y, "alpha": 2.0})
    assert leaves == pytree.tree_leaves(((x, 1), {"other": y, "alpha": 2.0}))
    assert flatten_values((x, y), {})[1] != flatten_values((x,), {"other": y})[1]
    nested, nested_nesting = flatten_values(((x, y), 0), {})
    assert nested == [x, y, 0] and nested_nesting != nesting
