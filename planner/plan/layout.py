"""Where every stage runs: the one map from (stage, replica) to ranks. No other module computes a rank.

Vocabulary (the plan separates what a stage computes from where it runs):

* a **part** is what a stage computes: a contiguous run of graph nodes (``plan.stages[part]``);
* a **stage** is what the schedule's actions name (``2F5``: stage 2, forward, micro-batch 5). It
  runs one part; usually stage s runs part s, but a GEMS mirror runs every part twice (two model
  copies in opposite directions), so stages may outnumber parts;
* a **slot** is one program of the schedule: the stages one worker runs, in order (one stage for
  GPipe/1F1B; several for interleaved stages or a GEMS mirror pair). A stage's position among its
  slot's stages is its *virtual stage*;
* a **replica** is one copy of the whole pipeline for data parallelism; every replica runs the
  same programs on its own ranks;
* a slot of a replica runs on one rank, or on several that split its work into spatial tiles
  (each tile rank runs the slot's program on its tile).

Standard library only.

>>> layout = Layout.pipeline(num_stages=2, data_parallel=2)
>>> layout.ranks_of(stage=1, replica=0), layout.stages_of_rank(3)
((2,), (1,))
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TypeVar

from cost_models.units import plural
from planner.plan import codec

P = TypeVar("P")  # one slot's program, in whatever form


@dataclass(frozen=True)
class RankPlace:
    """Where one rank sits in a layout."""

    replica: int
    slot: int
    tile: int  # position among the ranks that split the slot spatially (0 when it is not split)


@dataclass(frozen=True)
class Layout:
    """Stages to slots to ranks, for every replica; validated on construction.

    ``stage_part[stage]`` is the part a stage computes, ``stage_slot[stage]`` the slot (program)
    that runs it, and ``slot_ranks[replica][slot]`` the ranks that run that slot of that replica
    (several when the slot is split into spatial tiles). Every rank appears exactly once.
    """

    stage_part: tuple[int, ...]
    stage_slot: tuple[int, ...]
    slot_ranks: tuple[tuple[tuple[int, ...], ...], ...]

    def __post_init__(self) -> None:
        for name in ("stage_part", "stage_slot"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        object.__setattr__(self, "slot_ranks", tuple(tuple(tuple(int(r) for r in ranks) for ranks in slots)
                                                     for slots in self.slot_ranks))
        _check(self)

    # ------------------------------------------------------------ constructors
    @classmethod
    def pipeline(cls, num_stages: int, data_parallel: int = 1, tiles: Sequence[int] | None = None) -> Layout:
        """Stage s on its own slot, computing part s (GPipe, 1F1B), replicated ``data_parallel`` times;
        ``tiles[s]`` ranks run stage s's spatial tiles (default one each), a replica's tiles on
        consecutive ranks.

        >>> Layout.pipeline(2, data_parallel=2, tiles=(2, 1)).slot_ranks
        (((0, 1), (4,)), ((2, 3), (5,)))
        """
        return cls.replicated(tuple(range(num_stages)), data_parallel, tiles=tiles)

    @classmethod
    def replicated(cls, stage_slot: Sequence[int], data_parallel: int = 1, *,
                   stage_part: Sequence[int] | None = None, tiles: Sequence[int] | None = None) -> Layout:
        """The standard numbering: slot by slot, within a slot replica by replica, then tile by tile.

        A slot's replicas sit on consecutive ranks (so its data-parallel all-reduce stays within a
        node as long as it can); with one tile per slot, slot k of replica r is rank k * D + r.
        ``stage_part`` defaults to stage s computing part s; ``tiles`` to one rank per slot.

        >>> Layout.replicated((0, 1, 0, 1), data_parallel=2).slot_ranks
        (((0,), (2,)), ((1,), (3,)))
        >>> Layout.replicated((0, 1), tiles=(2, 1)).slot_ranks
        (((0, 1), (2,)),)
        """
        if data_parallel < 1:
            raise ValueError(f"data_parallel must be >= 1, got {data_parallel}")
        num_slots = max(stage_slot, default=-1) + 1
        tiles = tuple(tiles) if tiles is not None else (1,) * num_slots
        if len(tiles) != num_slots or min(tiles, default=1) < 1:
            raise ValueError(f"tiles {list(tiles)} must give a count >= 1 for each of the {num_slots} slots")
        first_rank = [data_parallel * sum(tiles[:slot]) for slot in range(num_slots)]
        slot_ranks = tuple(tuple(tuple(range(first_rank[slot] + replica * tiles[slot],
                                             first_rank[slot] + (replica + 1) * tiles[slot]))
                                 for slot in range(num_slots))
                           for replica in range(data_parallel))
        parts = tuple(stage_part) if stage_part is not None else tuple(range(len(stage_slot)))
        return cls(parts, tuple(stage_slot), slot_ranks)

    @classmethod
    def mirrored(cls, num_parts: int, data_parallel: int = 1) -> Layout:
        """GEMS-MASTER's placement: two model copies in opposite directions. Copy A's stage k computes
        part k on slot k; copy B's stage ``num_parts + k`` computes part k on slot ``num_parts - 1 - k``.

        >>> layout = Layout.mirrored(2)
        >>> layout.stages_of_rank(0), layout.stage_part, layout.copy(3), layout.stage_of_copy(part=0, copy=1)
        ((0, 3), (0, 1, 0, 1), 1, 2)
        """
        stage_slot = tuple(range(num_parts)) + tuple(num_parts - 1 - part for part in range(num_parts))
        return cls.replicated(stage_slot, data_parallel, stage_part=tuple(range(num_parts)) * 2)

    # ------------------------------------------------------------- sizes
    @property
    def num_stages(self) -> int:
        return len(self.stage_part)

    @property
    def num_parts(self) -> int:
        return max(self.stage_part) + 1

    @property
    def num_slots(self) -> int:
        return len(self.slot_ranks[0])

    @property
    def data_parallel(self) -> int:
        """Replicas of the whole pipeline."""
        return len(self.slot_ranks)

    @property
    def world_size(self) -> int:
        return sum(len(ranks) for slots in self.slot_ranks for ranks in slots)

    @property
    def is_pipeline(self) -> bool:
        """One stage per slot, stage s computing part s, no spatial tiles (GPipe, 1F1B)."""
        one_each = self.stage_part == tuple(range(self.num_stages)) and len(set(self.stage_slot)) == self.num_stages
        return one_each and all(len(ranks) == 1 for slots in self.slot_ranks for ranks in slots)

    # ------------------------------------------------------------- lookups
    def part(self, stage: int) -> int:
        return self.stage_part[self._stage(stage)]

    def slot(self, stage: int) -> int:
        return self.stage_slot[self._stage(stage)]

    def stages_on_slot(self, slot: int) -> tuple[int, ...]:
        """The stages one program runs, in stage order."""
        return self._slot_stages[slot]

    def virtual_stage(self, stage: int) -> int:
        """The stage's position among the stages of its slot (0 unless the slot holds several)."""
        return self.stages_on_slot(self.slot(stage)).index(stage)

    def stages_of_part(self, part: int) -> tuple[int, ...]:
        """The stages that compute ``part`` (two for a GEMS mirror pair)."""
        return self._part_stages.get(part, ())

    @property
    def num_copies(self) -> int:
        """Model copies inside one replica: stages per part (2 for a GEMS mirror, else 1)."""
        return self.num_stages // self.num_parts

    def copy(self, stage: int) -> int:
        """The model copy ``stage`` belongs to: its position among the stages that compute its part."""
        return self.stages_of_part(self.part(stage)).index(stage)

    def stage_of_copy(self, part: int, copy: int) -> int:
        """The stage of model copy ``copy`` that computes ``part`` (where a value of that copy goes)."""
        return self.stages_of_part(part)[copy]

    def copy_edges(self, part_edges: Iterable[tuple[int, int]]) -> frozenset[tuple[int, int]]:
        """The (src stage, dst stage) pairs that part-to-part edges join: within each model copy."""
        return frozenset((self.stage_of_copy(src, copy), self.stage_of_copy(dst, copy))
                         for src, dst in part_edges for copy in range(self.num_copies))

    def ranks_of(self, stage: int, replica: int) -> tuple[int, ...]:
        """The ranks that run ``stage`` of ``replica`` (several: its spatial tiles)."""
        if not 0 <= replica < self.data_parallel:
            raise ValueError(f"replica {replica} is out of range; the layout has {self.data_parallel}")
        return self.slot_ranks[replica][self.slot(stage)]

    def place(self, rank: int) -> RankPlace:
        """Where ``rank`` sits: its replica, slot and tile."""
        try:
            return self._places[rank]
        except KeyError:
            raise ValueError(f"rank {rank} is not in this layout of {self.world_size} ranks") from None

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        return self.stages_on_slot(self.place(rank).slot)

    def parts_of_rank(self, rank: int) -> tuple[int, ...]:
        """The parts whose weights ``rank`` holds (one per stage it runs; a mirror copy's is its part),
        sorted.

        >>> Layout.mirrored(2).parts_of_rank(0)
        (0, 1)
        """
        return tuple(sorted({self.part(stage) for stage in self.stages_of_rank(rank)}))

    def part_ranks(self, part: int) -> tuple[int, ...]:
        """Every rank holding a copy of ``part``'s weights (replicas, mirror copies and tiles), sorted:
        the group that sums its gradients."""
        return tuple(sorted({rank for stage in self.stages_of_part(part)
                             for replica in range(self.data_parallel) for rank in self.ranks_of(stage, replica)}))

    def parts_ranks(self, parts: Iterable[int]) -> tuple[int, ...]:
        """Every rank holding a copy of one of ``parts``, sorted: the group that sums a weight they share."""
        return tuple(sorted({rank for part in parts for rank in self.part_ranks(part)}))

    def channels(self, src_stage: int, dst_stage: int, replica: int) -> tuple[tuple[int, int], ...]:
        """The (src rank, dst rank) pairs a message from one stage to another travels in one replica:
        every tile of the sender to every tile of the receiver (a join gathers, a split scatters)."""
        return tuple((src, dst) for src in self.ranks_of(src_stage, replica)
                     for dst in self.ranks_of(dst_stage, replica) if src != dst)

    def rank_programs(self, slot_programs: Sequence[P]) -> tuple[P, ...]:
        """Per rank, the program of its slot."""
        if len(slot_programs) != self.num_slots:
            raise ValueError(f"got {len(slot_programs)} slot programs for {self.num_slots} slots")
        return tuple(slot_programs[self.place(rank).slot] for rank in range(self.world_size))

    def describe_ranks(self, stage: int) -> str:
        """The ranks of a stage over all replicas, compactly: ``0,1`` or ``0..7`` (``0-3|4-7`` for tiles)."""
        groups = [self.ranks_of(stage, replica) for replica in range(self.data_parallel)]
        texts = [str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}" for ranks in groups]
        flat = [rank for ranks in groups for rank in ranks]
        single = all(len(ranks) == 1 for ranks in groups)
        if len(texts) > 4 and single and flat == list(range(flat[0], flat[-1] + 1)):
            return f"{flat[0]}..{flat[-1]}"
        return ("," if single else "|").join(texts)

    def describe(self) -> str:
        """How the ranks hold the model, in counts that multiply to the world size.

        >>> Layout.pipeline(2, data_parallel=4).describe()
        '2 stages x 4 data-parallel'
        >>> Layout.replicated((0, 1, 0, 1), data_parallel=2).describe()  # interleaved: two stages a rank
        '4 stages on 2 ranks x 2 data-parallel'
        >>> Layout.mirrored(2, data_parallel=8).describe()  # GEMS-MASTER: two copies of 2 parts
        '4 stages of 2 parts on 2 ranks x 8 data-parallel'
        """
        ranks = sum(len(slot) for slot in self.slot_ranks[0])  # a replica's
        shape = plural(self.num_stages, "stage")
        if self.num_parts != self.num_stages:
            shape += f" of {plural(self.num_parts, 'part')}"
        if ranks != self.num_stages:
            shape += f" on {plural(ranks, 'rank')}"
        return f"{shape} x {self.data_parallel} data-parallel"

    # ------------------------------------------------------------- internals
    def _stage(self, stage: int) -> int:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is out of range; the layout has {self.num_stages} stages")
        return stage

    @cached_property
    def _slot_stages(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(stage for stage, owner in enumerate(self.stage_slot) if owner == slot)
                     for slot in range(self.num_slots))

    @cached_property
    def _part_stages(self) -> dict[int, tuple[int, ...]]:
        stages: dict[int, tuple[int, ...]] = {}
        for stage, part in enumerate(self.stage_part):
            stages[part] = (*stages.get(part, ()), stage)
        return stages

    @cached_property
    def _places(self) -> dict[int, RankPlace]:
        return {rank: RankPlace(replica, slot, tile) for replica, slots in enumerate(self.slot_ranks)
                for slot, ranks in enumerate(slots) for tile, rank in enumerate(ranks)}


def _check(layout: Layout) -> None:
    """Every part computed, every slot used, every rank 0..W-1 exactly once, tiles alike in replicas."""
    if not layout.stage_part or len(layout.stage_part) != len(layout.stage_slot):
        raise ValueError(f"stage_part {list(layout.stage_part)} and stage_slot {list(layout.stage_slot)} "
                         f"must name a part and a slot for each of at least one stage")
    if set(layout.stage_part) != set(range(max(layout.stage_part) + 1)):
        raise ValueError(f"stage_part {list(layout.stage_part)} must compute every part 0..P-1")
    copies = {layout.stage_part.count(part) for part in set(layout.stage_part)}
    if len(copies) != 1:
        raise ValueError(f"stage_part {list(layout.stage_part)} must compute every part equally often "
                         f"(once per model copy)")
    if not layout.slot_ranks or not layout.slot_ranks[0]:
        raise ValueError("slot_ranks must hold at least one replica with at least one slot")
    num_slots = len(layout.slot_ranks[0])
    if set(layout.stage_slot) != set(range(num_slots)):
        raise ValueError(f"stage_slot {list(layout.stage_slot)} must use every slot 0..{num_slots - 1}")
    shape = [len(ranks) for ranks in layout.slot_ranks[0]]
    for replica, slots in enumerate(layout.slot_ranks):
        if [len(ranks) for ranks in slots] != shape or min(shape) < 1:
            raise ValueError(f"replica {replica} has slots of {[len(r) for r in slots]} ranks but replica 0 "
                             f"has {shape}; every replica needs the same slots, each with >= 1 rank")
    ranks = sorted(rank for slots in layout.slot_ranks for group in slots for rank in group)
    if ranks != list(range(len(ranks))):
        raise ValueError(f"the layout's ranks {ranks} must be 0..{len(ranks) - 1}, each exactly once")


def layout_from_dict(data: object, path: str) -> Layout:
    """Decode a layout from its JSON form (``Layout``'s fields), checking it like any other."""
    slot_ranks = codec.tuple_of(codec.tuple_of(codec.tuple_of(codec.integer)))
    try:
        return codec.fields(Layout, data, path, {"stage_part": codec.tuple_of(codec.integer),
                                                 "stage_slot": codec.tuple_of(codec.integer),
                                                 "slot_ranks": slot_ranks})
    except ValueError as error:
        message = str(error)
        raise ValueError(message if message.startswith(path) else f"{path}: {message}") from None
