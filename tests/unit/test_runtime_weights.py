"""runtime.initialize: any subset of modules, in any order, on any rank gets the same weights."""

from __future__ import annotations

import torch
from torch import nn

from examples.models.gpt import gpt_tiny
from examples.models.resnet import resnet50
from runtime import initialize


def _names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_modules()]


def test_modules_initialised_piecewise_equal_the_whole_model() -> None:
    whole = initialize(gpt_tiny(dropout=0.0, device="meta"), seed=3)
    pieces = gpt_tiny(dropout=0.0, device="meta")
    names = _names(pieces)
    for part in (names[2::3], names[1::3], names[0::3]):  # any order, any split
        initialize(pieces, seed=3, modules=part)
    for (name, expected), (_, actual) in zip(whole.named_parameters(), pieces.named_parameters()):
        assert torch.equal(expected, actual), name


def test_a_subset_leaves_the_other_modules_on_meta() -> None:
    model = initialize(gpt_tiny(device="meta"), seed=0, modules={"blocks.1.mlp.fc"})
    assert model.blocks[1].mlp.fc.weight.device.type == "cpu"
    assert model.blocks[0].mlp.fc.weight.device.type == "meta"


def test_seeds_differ_and_batch_norm_buffers_are_reset() -> None:
    first = initialize(resnet50(width=4, num_classes=10, device="meta"), seed=0)
    second = initialize(resnet50(width=4, num_classes=10, device="meta"), seed=1)
    assert not torch.equal(first.conv1.weight, second.conv1.weight)
    assert torch.equal(first.bn1.running_var, torch.ones(4)) and int(first.bn1.num_batches_tracked) == 0


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 3)
        self.head = nn.Linear(3, 7)
        self.head.weight = self.embed.weight


def test_a_tied_weight_takes_its_first_holder_even_when_only_the_second_is_asked_for() -> None:
    with torch.device("meta"):
        whole, part = _Tied(), _Tied()
    initialize(whole, seed=5)
    initialize(part, seed=5, modules={"head"})
    assert part.head.weight is part.embed.weight
    assert torch.equal(part.head.weight, whole.embed.weight)
    assert torch.equal(part.head.bias, whole.head.bias)


class _Bare(nn.Module):
    """A module with a direct parameter and no reset_parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(4096))


def test_a_module_without_reset_parameters_gets_seeded_normal_002() -> None:
    with torch.device("meta"):
        model = _Bare()
    initialize(model, seed=0, device="cpu")
    assert abs(float(model.scale.detach().std()) - 0.02) < 0.002
    again = initialize(_Bare().to("meta"), seed=0)
    assert torch.equal(model.scale, again.scale)
