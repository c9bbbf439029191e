"""Conv and pool layers as sliding windows: validation, and computing any output region from input pixels.

``compute_region`` is the one primitive every tiled layer uses: given a tensor that covers some
input region and the output region wanted, it crops the input the window reads, pads only where
that reaches past the true image border (zeros for conv and avg pool, -inf for max pool) and runs
the layer with padding 0. Per-layer halos, interior/border overlap and fused groups all call it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from cost_models.errors import SpatialError
from cost_models.graph.ir import Geometry
from cost_models.halo import Region, Window, ceil_mode_refusal, ceil_rounds_up

WINDOW_MODULES = (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d)


class WindowKind(str, Enum):
    CONV = "conv"
    MAX_POOL = "max_pool"
    AVG_POOL = "avg_pool"


@dataclass(frozen=True)
class WindowSpec:
    """A conv/pool layer's windows along rows and columns, and the value its padding holds."""

    kind: WindowKind
    rows: Window
    cols: Window
    ceil_mode: bool = False  # a ceil-mode pool: tiled only at input sizes where it rounds as floor mode does

    @property
    def pad_value(self) -> float:
        return float("-inf") if self.kind is WindowKind.MAX_POOL else 0.0

    @property
    def exchanges_nothing(self) -> bool:
        """1x1 windows without padding read only their own pixel: no halo, whatever the stride."""
        return all(w.kernel == 1 and w.padding == 0 for w in (self.rows, self.cols))

    def geometry(self) -> Geometry:
        """The planner's description of the same window (for cost_models.halo)."""
        rows, cols = self.rows, self.cols
        return Geometry(self.kind.value, (rows.kernel, cols.kernel), (rows.stride, cols.stride),
                        (rows.padding, cols.padding), (rows.dilation, cols.dilation), ceil_mode=self.ceil_mode)

    def check_size(self, height: int, width: int, name: str) -> None:
        """SpatialError unless a ceil-mode window rounds as floor mode at this input size (the tiles compute
        floor mode; cost_models.halo decides, for the planner too)."""
        if self.ceil_mode and ceil_rounds_up((self.rows, self.cols), (height, width)):
            kind = {WindowKind.MAX_POOL: "MaxPool2d", WindowKind.AVG_POOL: "AvgPool2d"}[self.kind]
            raise SpatialError(f"layer {name!r} ({kind}): {ceil_mode_refusal((height, width))}")


def _pair(value: int | tuple[int, ...]) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    return (value[0], value[0]) if len(value) == 1 else (value[0], value[1])


def _conv_padding(conv: nn.Conv2d, name: str) -> tuple[int, int]:
    if not isinstance(conv.padding, str):
        return _pair(conv.padding)
    if conv.padding == "valid":
        return 0, 0
    totals = [d * (k - 1) for k, d in zip(conv.kernel_size, conv.dilation)]
    if any(total % 2 for total in totals):
        raise SpatialError(f"layer {name!r} (Conv2d): padding='same' with an even kernel pads unevenly "
                           f"({totals} pixels per dimension) and cannot be tiled; use an explicit padding")
    return totals[0] // 2, totals[1] // 2


def _check_conv(conv: nn.Conv2d, name: str) -> None:
    if conv.padding_mode != "zeros":
        raise SpatialError(f"layer {name!r} (Conv2d): padding_mode={conv.padding_mode!r} cannot be tiled exactly; "
                           f"use padding_mode='zeros' or join the tiles before this layer")
    if conv.in_channels % conv.groups or conv.out_channels % conv.groups:
        raise SpatialError(f"layer {name!r} (Conv2d): groups={conv.groups} does not divide in_channels="
                           f"{conv.in_channels} and out_channels={conv.out_channels}")


def _check_pool(pool: nn.MaxPool2d | nn.AvgPool2d, name: str) -> None:
    kind = type(pool).__name__
    if getattr(pool, "return_indices", False):
        raise SpatialError(f"layer {name!r} ({kind}): return_indices=True gives tile-local indices; "
                           f"use return_indices=False")


def window_spec(module: nn.Module, name: str) -> WindowSpec:
    """The WindowSpec of a Conv2d, MaxPool2d or AvgPool2d; SpatialError naming ``name`` otherwise."""
    if isinstance(module, nn.Conv2d):
        _check_conv(module, name)
        kernel, stride, dilation = _pair(module.kernel_size), _pair(module.stride), _pair(module.dilation)
        padding, kind = _conv_padding(module, name), WindowKind.CONV
    elif isinstance(module, nn.MaxPool2d):
        _check_pool(module, name)
        kernel, padding, dilation = _pair(module.kernel_size), _pair(module.padding), _pair(module.dilation)
        stride, kind = _pair(module.stride) if module.stride else kernel, WindowKind.MAX_POOL
    elif isinstance(module, nn.AvgPool2d):
        _check_pool(module, name)
        kernel, padding, dilation = _pair(module.kernel_size), _pair(module.padding), (1, 1)
        stride, kind = _pair(module.stride) if module.stride else kernel, WindowKind.AVG_POOL
    else:
        raise SpatialError(f"layer {name!r} ({type(module).__name__}) is not a Conv2d, MaxPool2d or AvgPool2d")
    rows, cols = (Window(k, s, p, d) for k, s, p, d in zip(kernel, stride, padding, dilation))
    return WindowSpec(kind, rows, cols, ceil_mode=bool(getattr(module, "ceil_mode", False)))


def _clip(lo: int, hi: int, length: int) -> tuple[int, int, int, int]:
    """Split a wanted input span into the part inside the image and the padding on either side."""
    inside_lo = min(max(lo, 0), length)
    inside_hi = max(min(hi, length), inside_lo)
    return inside_lo, inside_hi, inside_lo - lo, hi - inside_hi


def _real_counts(window: Window, outputs: int, pad_lo: int, real: int) -> list[int]:
    """Per output, how many of its window's pixels are real (not padding), for count_include_pad=False."""
    counts = []
    for index in range(outputs):
        start = index * window.stride
        counts.append(max(0, min(start + window.span, pad_lo + real) - max(start, pad_lo)))
    return counts


class ConvLayer(Protocol):
    """What running a convolution window needs: a Conv2d, or a SpatialConv2d sharing its parameters."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    groups: int


class AvgPoolLayer(Protocol):
    """What running an average-pool window needs: an AvgPool2d or a SpatialAvgPool2d."""

    count_include_pad: bool
    divisor_override: int | None


def _avg_pool(pool: AvgPoolLayer, spec: WindowSpec, block: torch.Tensor,
              pads: tuple[int, int, int, int], real: tuple[int, int]) -> torch.Tensor:
    kernel, stride = (spec.rows.kernel, spec.cols.kernel), (spec.rows.stride, spec.cols.stride)
    if pool.divisor_override or pool.count_include_pad:
        return F.avg_pool2d(block, kernel, stride, 0, divisor_override=pool.divisor_override)
    sums = F.avg_pool2d(block, kernel, stride, 0, divisor_override=1)
    rows = _real_counts(spec.rows, sums.shape[-2], pads[2], real[0])
    cols = _real_counts(spec.cols, sums.shape[-1], pads[0], real[1])
    counts = torch.tensor(rows, dtype=sums.dtype, device=sums.device)[:, None] * \
        torch.tensor(cols, dtype=sums.dtype, device=sums.device)[None, :]
    return sums / counts


def run_window(module: nn.Module, spec: WindowSpec, block: torch.Tensor,
               pads: tuple[int, int, int, int], real: tuple[int, int]) -> torch.Tensor:
    """Apply the layer with padding 0 to an already padded block (``pads`` in F.pad order)."""
    stride = (spec.rows.stride, spec.cols.stride)
    dilation = (spec.rows.dilation, spec.cols.dilation)
    if spec.kind is WindowKind.CONV:
        conv = cast(ConvLayer, module)
        return F.conv2d(block, conv.weight, conv.bias, stride, 0, dilation, conv.groups)
    if spec.kind is WindowKind.MAX_POOL:
        return F.max_pool2d(block, (spec.rows.kernel, spec.cols.kernel), stride, 0, dilation)
    return _avg_pool(cast(AvgPoolLayer, module), spec, block, pads, real)


def compute_region(module: nn.Module, spec: WindowSpec, x: torch.Tensor, x_region: Region,
                   out_region: Region, image: Region) -> torch.Tensor:
    """The layer's output over ``out_region`` from ``x``, a tensor covering ``x_region`` of the input.

    ``x_region`` must hold every in-image input pixel the outputs read; reads past the image border
    become padding.
    """
    row_lo, row_hi = spec.rows.input_span(out_region.row_lo, out_region.row_hi)
    col_lo, col_hi = spec.cols.input_span(out_region.col_lo, out_region.col_hi)
    top, bottom, pad_top, pad_bottom = _clip(row_lo, row_hi, image.height)
    left, right, pad_left, pad_right = _clip(col_lo, col_hi, image.width)
    inside = Region(top, bottom, left, right)
    assert x_region.contains(inside), f"{x_region} does not cover the {inside} that {out_region} reads"
    block = x[(..., *inside.offsets_in(x_region))]
    pads = (pad_left, pad_right, pad_top, pad_bottom)
    if any(pads):
        block = F.pad(block, pads, value=spec.pad_value)
    return run_window(module, spec, block, pads, (inside.height, inside.width))
