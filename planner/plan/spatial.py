"""A stage's spatial section: the image of its input cut into P tiles, one per rank of its slot.

Standard library only. The geometry mirrors runtime.spatial.TileGrid (which the runtime builds
from this section): ``square`` cuts a sqrt(P) x sqrt(P) grid, ``vertical`` P column strips,
``horizontal`` P row strips; rows and columns are split into tiles differing by at most one pixel.

>>> spec = SpatialSpec(parts=4, slicing=Slicing.SQUARE, halo=HaloMode.PER_LAYER, height=32, width=32)
>>> spec.grid_shape, spec.describe()
((2, 2), '4 tiles (square), per-layer halos')
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from math import isqrt
from typing import Any

from planner.plan import codec


class Slicing(str, Enum):
    """How P ranks cut the image (the values of runtime.spatial.Slicing)."""

    SQUARE = "square"
    VERTICAL = "vertical"  # 1 row of P column strips
    HORIZONTAL = "horizontal"  # P row strips, top to bottom


class HaloMode(str, Enum):
    """Per-layer halo exchange before every conv/pool, or one wide exchange per fused group of layers."""

    PER_LAYER = "per-layer"
    FUSED = "fused"


def grid_shape(parts: int, slicing: Slicing) -> tuple[int, int]:
    """(rows, cols) of ``parts`` tiles cut as ``slicing``; (0, 0) when ``parts`` is not valid for it."""
    if parts < 1:
        return 0, 0
    if slicing is Slicing.VERTICAL:
        return 1, parts
    if slicing is Slicing.HORIZONTAL:
        return parts, 1
    side = isqrt(parts)
    return (side, side) if side * side == parts else (0, 0)


@dataclass(frozen=True)
class SpatialSpec:
    """A spatial stage: ``parts`` tiles of the ``height`` x ``width`` input image, one per rank of the slot.

    Tile ``t`` of a replica is the stage's ``t``-th rank in the layout (``layout.ranks_of``), and
    sits at row ``t // cols``, column ``t % cols`` of the grid. ``fused_groups`` (only with fused
    halos) are runs of the stage's node names that each exchange one wide halo; empty means the
    whole stage is one group.
    """

    parts: int
    slicing: Slicing
    halo: HaloMode
    height: int  # of the stage's input image, in pixels
    width: int
    fused_groups: tuple[tuple[str, ...], ...] = ()
    halo_bytes: tuple[int, ...] = ()  # predicted, per tile: halo bytes it sends per micro-batch (forward,
    # recomputed forward and backward exchanges)

    def __post_init__(self) -> None:
        object.__setattr__(self, "slicing", Slicing(self.slicing))
        object.__setattr__(self, "halo", HaloMode(self.halo))
        object.__setattr__(self, "fused_groups", tuple(tuple(group) for group in self.fused_groups))
        object.__setattr__(self, "halo_bytes", tuple(self.halo_bytes))

    @property
    def grid_shape(self) -> tuple[int, int]:
        """(rows, cols) of the tile grid; (0, 0) when ``parts`` is not valid for the slicing."""
        return grid_shape(self.parts, self.slicing)

    def describe(self) -> str:
        """E.g. "4 tiles (square), per-layer halos" or "2 tiles (vertical), fused halos (3 groups, 36 nodes)"
        (the nodes outside the groups exchange per layer)."""
        halo = "per-layer halos" if self.halo is HaloMode.PER_LAYER else "fused halos"
        if self.fused_groups:
            count = len(self.fused_groups)
            halo += (f" ({count} group{'s' if count != 1 else ''}, "
                     f"{sum(len(group) for group in self.fused_groups)} nodes)")
        return f"{self.parts} tiles ({self.slicing.value}), {halo}"

    @classmethod
    def from_dict(cls, data: Any, path: str) -> SpatialSpec:
        return codec.fields(cls, data, path, {
            "parts": codec.integer, "slicing": codec.enum_of(Slicing), "halo": codec.enum_of(HaloMode),
            "height": codec.integer, "width": codec.integer,
            "fused_groups": codec.tuple_of(codec.tuple_of(codec.string)),
            "halo_bytes": codec.tuple_of(codec.integer)},
            optional=frozenset({"fused_groups", "halo_bytes"}))
