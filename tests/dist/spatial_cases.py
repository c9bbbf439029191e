"""Rank functions for the spatial tests: each loops over many cases in one process group and reports.

Every function returns ``(checked, failures)``: how many comparisons ran and a description of each
one that did not match, so the parent test can assert both (an empty loop cannot pass).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from cost_models.halo import halo_cost
from cost_models.presets import PRESETS
from runtime.spatial import (
    FusedHaloBlock,
    SpatialBatchNorm2d,
    SpatialConv2d,
    TileGrid,
    allreduce_replicated_grads,
    count_messages,
    fuse_sequential,
    gather_tiles,
    output_grid,
    spatialize,
)
from runtime.spatial.layers import SpatialAvgPool2d, SpatialMaxPool2d, SpatialWindowLayer

TOLERANCE = {"rtol": 1e-10, "atol": 1e-12}
MODEL_TOLERANCE = {"rtol": 1e-9, "atol": 1e-11}
SIZES = ((41, 36), (36, 41))  # odd x even and even x odd images


class Report:
    """Collects comparisons; a failure records the case and torch.testing's explanation."""

    def __init__(self) -> None:
        self.checked = 0
        self.failures: list[str] = []

    def close(self, case: str, what: str, actual: torch.Tensor, expected: torch.Tensor,
              tolerance: dict[str, float] = TOLERANCE) -> None:
        self.checked += 1
        try:
            torch.testing.assert_close(actual, expected, **tolerance)
        except AssertionError as error:
            self.failures.append(f"{case}: {what}: {str(error).splitlines()[0:3]}")

    def true(self, case: str, what: str, condition: bool) -> None:
        self.checked += 1
        if not condition:
            self.failures.append(f"{case}: {what}")

    def result(self) -> tuple[int, list[str]]:
        return self.checked, self.failures


@dataclass(frozen=True)
class LayerCase:
    """One layer to tile: a name, a factory, the image size and input channels."""

    name: str
    make: Callable[[], nn.Module]
    height: int
    width: int
    channels: int = 2


def _conv_cases() -> list[LayerCase]:
    cases = []
    index = 0
    for kernel in (1, 3, 5, 7):
        for stride in (1, 2):
            for dilation in (1, 2):
                for padding in (dilation * (kernel - 1) // 2, 0):
                    height, width = SIZES[index % 2]
                    index += 1

                    def make(k: int = kernel, s: int = stride, d: int = dilation, p: int = padding) -> nn.Module:
                        return nn.Conv2d(2, 3, k, stride=s, padding=p, dilation=d)
                    cases.append(LayerCase(f"conv k{kernel} s{stride} d{dilation} p{padding}", make, height, width))
    return cases


def _extra_conv_cases() -> list[LayerCase]:
    return [
        LayerCase("conv groups=2", lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2), 41, 36, channels=4),
        LayerCase("conv no bias s2", lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1, bias=False), 36, 41),
        LayerCase("conv 1x7", lambda: nn.Conv2d(2, 3, (1, 7), padding=(0, 3)), 41, 36),
        LayerCase("conv 7x1 s(2,1)", lambda: nn.Conv2d(2, 3, (7, 1), stride=(2, 1), padding=(3, 0)), 36, 41),
        LayerCase("conv padding='same' d2", lambda: nn.Conv2d(2, 3, 5, padding="same", dilation=2), 41, 36),
        LayerCase("conv over-padded k3 p2", lambda: nn.Conv2d(2, 3, 3, padding=2), 36, 41),
        LayerCase("conv 1x1 p1", lambda: nn.Conv2d(2, 3, 1, padding=1), 41, 36),
        LayerCase("conv k4 s2 p1 (even kernel)", lambda: nn.Conv2d(2, 3, 4, stride=2, padding=1), 36, 41),
        LayerCase("conv k7 d2 on tiny tiles", lambda: nn.Conv2d(2, 3, 7, padding=6, dilation=2), 10, 11),
        LayerCase("conv k5 s2 on tiny tiles", lambda: nn.Conv2d(2, 3, 5, stride=2, padding=2), 9, 12),
    ]


def _pool_cases() -> list[LayerCase]:
    return [
        LayerCase("maxpool k3 s2 p1", lambda: nn.MaxPool2d(3, 2, 1), 41, 36),
        LayerCase("maxpool k2 s2", lambda: nn.MaxPool2d(2, 2), 36, 41),
        LayerCase("maxpool k3 s1 p1", lambda: nn.MaxPool2d(3, 1, 1), 41, 36),
        LayerCase("maxpool k3 s2 p1 d2", lambda: nn.MaxPool2d(3, 2, 1, dilation=2), 36, 41),
        LayerCase("maxpool (3,2) s(2,1) p(1,0)", lambda: nn.MaxPool2d((3, 2), (2, 1), (1, 0)), 41, 36),
        LayerCase("avgpool k3 s1 p1 exclude pad", lambda: nn.AvgPool2d(3, 1, 1, count_include_pad=False), 41, 36),
        LayerCase("avgpool k3 s1 p1 include pad", lambda: nn.AvgPool2d(3, 1, 1), 36, 41),
        LayerCase("avgpool k2 s2", lambda: nn.AvgPool2d(2, 2), 41, 36),
        LayerCase("avgpool k3 s2 p1 exclude pad", lambda: nn.AvgPool2d(3, 2, 1, count_include_pad=False), 36, 41),
        LayerCase("avgpool k5 s2 p2 divisor 7", lambda: nn.AvgPool2d(5, 2, 2, divisor_override=7), 41, 36),
        LayerCase("avgpool k3 s2 p0", lambda: nn.AvgPool2d(3, 2), 36, 41),
        LayerCase("maxpool k2 s2 ceil mode, even size", lambda: nn.MaxPool2d(2, 2, ceil_mode=True), 36, 40),
    ]


def layer_cases() -> list[LayerCase]:
    return _conv_cases() + _extra_conv_cases() + _pool_cases()


def _tiled(layer: nn.Module, grid: TileGrid, overlap: bool) -> SpatialWindowLayer:
    if isinstance(layer, nn.Conv2d):
        return SpatialConv2d.from_module(layer, grid, None, name="case", overlap=overlap)
    if isinstance(layer, nn.MaxPool2d):
        return SpatialMaxPool2d.from_module(layer, grid, None, name="case", overlap=overlap)
    return SpatialAvgPool2d.from_module(layer, grid, None, name="case", overlap=overlap)


def _check_messages(report: Report, case: str, tiled: SpatialWindowLayer, rank: int, channels: int,
                    batch: int) -> None:
    """The runtime's message and byte counts equal cost_models.halo's prediction."""
    link = PRESETS["V100-16GB"].intra_node
    predicted = halo_cost(tiled.spec.geometry(), tiled.input_grid, rank, channels=channels, dtype_bytes=8,
                          batch=batch, link=link)
    counted = tiled.exchange.counter
    report.true(case, f"forward messages {counted.forward_messages} == predicted {predicted.messages}",
                counted.forward_messages == predicted.messages)
    report.true(case, f"forward bytes {counted.forward_bytes} == predicted {predicted.bytes_sent}",
                counted.forward_bytes == predicted.bytes_sent)
    report.true(case, f"backward messages {counted.backward_messages} == receives {len(predicted.recv_bytes)}",
                counted.backward_messages == len(predicted.recv_bytes))
    if tiled.spec.exchanges_nothing:
        report.true(case, "a 1x1 window exchanges nothing", counted.forward_messages == 0)


def _check_layer(report: Report, case: LayerCase, rank: int, grid: TileGrid, overlap: bool) -> None:
    label = f"{case.name} {grid.slicing.value} {grid.parts} ranks {case.height}x{case.width} overlap={overlap}"
    reference = case.make().double()
    tiled = _tiled(copy.deepcopy(reference), grid, overlap)
    x = torch.randn(2, case.channels, case.height, case.width, dtype=torch.float64, requires_grad=True)
    expected = reference(x)
    grad_out = torch.randn_like(expected)
    expected.backward(grad_out)
    tile = grid.tile(x.detach(), rank).clone().requires_grad_()
    out = tiled(tile)
    out.backward(tiled.output_grid.tile(grad_out, rank))
    allreduce_replicated_grads(tiled, None)
    report.close(label, "gathered output", gather_tiles(out, tiled.output_grid, None), expected.detach())
    report.close(label, "input grad", tile.grad, grid.tile(x.grad, rank))
    for name, parameter in reference.named_parameters():
        report.close(label, f"{name} grad", getattr(tiled, name).grad, parameter.grad)
    _check_messages(report, label, tiled, rank, case.channels, 2)


def _check_batch_norm(report: Report, rank: int, grid: TileGrid) -> None:
    for momentum, affine in ((0.1, True), (None, True), (0.3, False)):
        label = f"batchnorm momentum={momentum} affine={affine} {grid.slicing.value} {grid.parts} ranks"
        reference = nn.BatchNorm2d(3, momentum=momentum, affine=affine).double()
        if affine:
            nn.init.normal_(reference.weight)
            nn.init.normal_(reference.bias)
        tiled = SpatialBatchNorm2d.from_module(copy.deepcopy(reference), None)
        x = (torch.randn(2, 3, 41, 36, dtype=torch.float64) * 3 + 1).requires_grad_()
        for step in range(2):  # two steps: running statistics move twice
            x.grad = None
            expected = reference(x)
            grad_out = torch.randn_like(expected)
            expected.backward(grad_out)
            tile = grid.tile(x.detach(), rank).clone().requires_grad_()
            out = tiled(tile)
            out.backward(grid.tile(grad_out, rank))
            report.close(label, f"step {step} output", gather_tiles(out, grid, None), expected.detach())
            report.close(label, f"step {step} input grad", tile.grad, grid.tile(x.grad, rank))
        allreduce_replicated_grads(tiled, None)
        for name, parameter in reference.named_parameters():
            report.close(label, f"{name} grad", getattr(tiled, name).grad, parameter.grad)
        for name, buffer in reference.named_buffers():
            report.close(label, f"{name}", getattr(tiled, name), buffer)
        tiled.eval(), reference.eval()
        report.close(label, "eval output", gather_tiles(tiled(grid.tile(x.detach(), rank)), grid, None),
                     reference(x).detach())


def _check_per_tile_batch_norm(report: Report, rank: int, grid: TileGrid) -> None:
    """sync=False normalises each tile alone: equal to BatchNorm2d on the tile, not on the image."""
    label = f"per-tile batchnorm {grid.slicing.value} {grid.parts} ranks"
    reference = nn.BatchNorm2d(3).double()
    tiled = SpatialBatchNorm2d.from_module(copy.deepcopy(reference), None, sync=False)
    x = torch.randn(2, 3, 41, 36, dtype=torch.float64) + torch.linspace(0, 4, 36, dtype=torch.float64)
    tile = grid.tile(x, rank)
    out = tiled(tile)
    report.close(label, "equals BatchNorm2d of the tile", out, copy.deepcopy(reference)(tile).detach())
    whole = grid.tile(reference(x), rank).detach()
    report.true(label, "differs from the unpartitioned batch norm", not torch.allclose(out, whole))


def _check_gather_to_one_rank(report: Report, rank: int, grid: TileGrid) -> None:
    x = torch.randn(2, 3, grid.height, grid.width, dtype=torch.float64)
    joined = gather_tiles(grid.tile(x, rank), grid, None, dst=1)
    label = f"gather to rank 1 {grid.slicing.value} {grid.parts} ranks"
    if rank == 1:
        report.close(label, "joined image", joined, x)
    else:
        report.true(label, "other ranks get None", joined is None)


def check_layers(rank: int, world_size: int, slicings: tuple[str, ...]) -> tuple[int, list[str]]:
    """Every layer case on every slicing: gathered output and all gradients equal the unpartitioned layer."""
    torch.manual_seed(1234)
    report = Report()
    for slicing in slicings:
        for index, case in enumerate(layer_cases()):
            grid = TileGrid.build(world_size, slicing, case.height, case.width)
            _check_layer(report, case, rank, grid, overlap=index % 5 != 4)
        grid = TileGrid.build(world_size, slicing, 41, 36)
        _check_batch_norm(report, rank, grid)
        _check_per_tile_batch_norm(report, rank, grid)
        _check_gather_to_one_rank(report, rank, grid)
    return report.result()


def _resnet_stem() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    from examples.models.resnet import resnet50

    model = resnet50(width=8, device="cpu").double()
    stem = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool, model.layer1)
    return stem, (torch.randn(2, 3, 96, 96, dtype=torch.float64),)


def _amoeba_cell() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    from examples.models.amoebanet import Cell

    cell = Cell(8, 8, 8, reduction=False, reduce_prev=False).double()
    return cell, (torch.randn(2, 8, 32, 32, dtype=torch.float64), torch.randn(2, 8, 32, 32, dtype=torch.float64))


def _strided_after_batch_norm() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A 1x1 stride-2 conv reads only every other pixel, yet batch-norm before it counts them all."""
    block = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Conv2d(4, 6, 1, stride=2), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(3, 1, 1))
    return block.double(), (torch.randn(2, 3, 36, 36, dtype=torch.float64),)


def _step(module: nn.Module, rank: int, grid: TileGrid, out_grid: TileGrid, inputs: tuple[torch.Tensor, ...],
          grad_out: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    tiles = [grid.tile(x, rank).clone().requires_grad_() for x in inputs]
    out = module(*tiles)
    out.backward(out_grid.tile(grad_out, rank))
    allreduce_replicated_grads(module, None)
    return out, [tile.grad for tile in tiles]


def _compare_models(report: Report, label: str, tiled: nn.Module, reference: nn.Module) -> None:
    """Every parameter gradient and buffer, in registration order (tiled versions keep the order)."""
    actual_params, expected_params = list(tiled.parameters()), list(reference.named_parameters())
    actual_buffers, expected_buffers = list(tiled.buffers()), list(reference.named_buffers())
    report.true(label, "as many parameters and buffers as the reference",
                (len(actual_params), len(actual_buffers)) == (len(expected_params), len(expected_buffers)))
    for actual, (name, expected) in zip(actual_params, expected_params):
        report.close(label, f"{name} grad", actual.grad, expected.grad, MODEL_TOLERANCE)
    for actual, (name, expected) in zip(actual_buffers, expected_buffers):
        report.close(label, name, actual, expected, MODEL_TOLERANCE)


def _check_model(report: Report, name: str, build: Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]],
                 rank: int, slicing: str, world_size: int) -> None:
    reference, inputs = build()
    height, width = inputs[0].shape[-2:]
    grid = TileGrid.build(world_size, slicing, height, width)
    out_grid = output_grid(reference, grid)
    per_layer = spatialize(copy.deepcopy(reference), grid, None)
    fused = FusedHaloBlock(copy.deepcopy(reference), grid, None)
    variants: list[tuple[str, nn.Module]] = [("per-layer", per_layer), ("fused", fused)]
    if isinstance(reference, nn.Sequential):  # two fused groups: all layers but the last, then the last
        sizes = [len(reference) - 1, 1]
        variants.append(("fused groups", fuse_sequential(copy.deepcopy(reference), grid, None, sizes)))
    leaves = [x.clone().requires_grad_() for x in inputs]
    expected = reference(*leaves)
    grad_out = torch.randn_like(expected)
    expected.backward(grad_out)
    outputs = {}
    for kind, tiled in variants:
        label = f"{name} {slicing} {kind}"
        out, input_grads = _step(tiled, rank, grid, out_grid, inputs, grad_out)
        outputs[kind] = out
        report.close(label, "gathered output", gather_tiles(out, out_grid, None), expected.detach(), MODEL_TOLERANCE)
        for index, (grad, leaf) in enumerate(zip(input_grads, leaves)):
            report.close(label, f"input {index} grad", grad, grid.tile(leaf.grad, rank), MODEL_TOLERANCE)
        _compare_models(report, label, tiled, reference)
    report.close(f"{name} {slicing}", "fused output == per-layer output", outputs["fused"], outputs["per-layer"],
                 MODEL_TOLERANCE)
    _check_counts(report, f"{name} {slicing}", per_layer, fused, grid, rank)
    _check_eval(report, f"{name} {slicing}", (reference, per_layer, fused), rank, grid, out_grid, inputs)


def _check_eval(report: Report, label: str, modules: tuple[nn.Module, ...], rank: int, grid: TileGrid,
                out_grid: TileGrid, inputs: tuple[torch.Tensor, ...]) -> None:
    """After the training step, eval mode (running statistics, no autograd) matches too."""
    reference, *tiled = (module.eval() for module in modules)
    with torch.no_grad():
        expected = out_grid.tile(reference(*inputs), rank)
        for module in tiled:
            actual = module(*(grid.tile(x, rank) for x in inputs))
            report.close(label, f"eval output of {type(module).__name__}", actual, expected, MODEL_TOLERANCE)


def _check_counts(report: Report, label: str, per_layer: nn.Module, fused: FusedHaloBlock, grid: TileGrid,
                  rank: int) -> None:
    link = PRESETS["V100-16GB"].intra_node
    layers = [m for m in per_layer.modules() if isinstance(m, SpatialWindowLayer)]
    predicted = sum(halo_cost(m.spec.geometry(), m.input_grid, rank, channels=1, dtype_bytes=1, batch=1,
                              link=link).messages for m in layers)
    per_layer_sent = count_messages(per_layer).forward_messages
    fused_sent = count_messages(fused).forward_messages
    neighbours = len(grid.neighbours(rank))
    report.true(label, f"per-layer messages {per_layer_sent} == cost model {predicted}", per_layer_sent == predicted)
    report.true(label, f"fused messages {fused_sent} == {len(fused.halo_exchanges)} exchanges x {neighbours} "
                       f"neighbours", fused_sent == len(fused.halo_exchanges) * neighbours)
    report.true(label, f"fused sends fewer messages ({fused_sent}) than per-layer ({per_layer_sent})",
                fused_sent < per_layer_sent)


def check_models(rank: int, world_size: int, slicings: tuple[str, ...]) -> tuple[int, list[str]]:
    """ResNet stem + first stage and an AmoebaNet normal cell, per-layer and fused, against one process."""
    report = Report()
    for slicing in slicings:
        for name, build in (("resnet50 stem+layer1", _resnet_stem), ("amoebanet normal cell", _amoeba_cell),
                            ("1x1 stride 2 after batch-norm", _strided_after_batch_norm)):
            torch.manual_seed(7)
            _check_model(report, name, build, rank, slicing, world_size)
    return report.result()
