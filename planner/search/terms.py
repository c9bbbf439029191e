"""Every cost of a partition, written once, as coefficients over the partition's decision variables.

The decision: units 0..U-1 go to parts 0..P-1, contiguously. A **term** is a quantity of one part
that is linear in the decision variables (plus at most one maximum over the units it holds):

    term(part holding units first..last) = constant
        + sum of per_unit[i]            for i in first..last        (x[i, part])
        + ends_after[last]              when the part is not the last (its outgoing cut)
        + starts_after[first - 1]       when the part is not the first (its incoming cut)
        + sum of per_shared[q]          for each shared parameter q its units use
        + max of unit_max[i]            over i in first..last
        + sum of per_recompute[i] r[i] + per_swap[i] w[i] + per_start[i] g[i]   for i in first..last

where r[i] and w[i] (0..1) are the memory decisions of unit i: the share of its saved activations
recomputed in the backward, and the share swapped to the host; g[i] = max(0, r[i] - r[i-1]) when
unit i - 1 is on the same part and in the same recompute block (RECOMPUTE_BLOCK_UNITS units), else
r[i]: the share of unit i that starts a checkpoint region (a run of recomputed units in one block,
which keeps only its first unit's inputs). Where model state lives (the
problem's StateMode: sharded or not, optimizer on the GPU, host or NVMe) is fixed per
configuration; the terms are written for it. A term built for the last part has no ``ends_after`` and one for the first part no
``starts_after``. The step time is a weighted sum of **aggregates** (sums or maxima of terms over
parts) and **drains** (the largest, over parts s, of a sum over parts s..P-1 plus a maximum over
them plus a term of s); every slot's memory is a **row** (a sum of terms) that must fit the
budget. From these
data the ILP's rows (planner/search/ilp.py), the evaluator of a given partition
(planner/search/evaluate.py) and the exact dynamic programs (planner/search/oracle.py) are
generated: a new cost (recompute time, host transfer, halo exchange) is a new term here and
nowhere else. :func:`cost_model` is the only function that writes cost formulas.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from cost_models.comm import (
    ALL_GATHER_SHARE,
    ALL_GATHER_STAGING,
    GATHER_ROW_HELD,
    GATHERS_AHEAD,
    KEPT_SUM_TABLE,
    LAYER_REDUCE_SHARE,
    RECEIVES_POSTED_AHEAD,
    hidden_share,
)
from cost_models.memory import step_bucket_bytes, step_transient_bytes, zero_gather_bytes
from planner.plan.kinds import ScheduleKind
from planner.plan.parts import StateTier
from planner.schedules.generate import STASHED_WEIGHT_VERSIONS
from planner.search.problem import (
    LinearCost,
    MemoryTiers,
    PipelineProblem,
    SharedParam,
    SpatialPart,
    StateMode,
    Unit,
    block_of,
    copy_state_bytes,
)


@dataclass(frozen=True, eq=False)
class Term:
    """One part's quantity (see the module docstring); empty tuples mean all-zero coefficients."""

    constant: float = 0.0
    per_unit: tuple[float, ...] = ()
    ends_after: tuple[float, ...] = ()
    starts_after: tuple[float, ...] = ()
    per_shared: tuple[float, ...] = ()
    unit_max: tuple[float, ...] = ()
    max_name: str = "max"  # what the maximum over units is (names its ILP variable)
    per_recompute: tuple[float, ...] = ()
    per_swap: tuple[float, ...] = ()
    per_start: tuple[float, ...] = ()
    family: str = ""  # what the term is ("fwd_ms"): a spatial part's differs in coefficients, not in kind

    def plus(self, other: Term, weight: float = 1.0) -> Term:
        """``self + weight * other`` (at most one of them may take a maximum over units)."""
        if self.unit_max and other.unit_max:
            raise ValueError("a term holds at most one maximum over units; keep the two terms apart")
        return Term(self.constant + weight * other.constant, _add(self.per_unit, other.per_unit, weight),
                    _add(self.ends_after, other.ends_after, weight),
                    _add(self.starts_after, other.starts_after, weight),
                    _add(self.per_shared, other.per_shared, weight),
                    _add(self.unit_max, other.unit_max, weight),
                    self.max_name if self.unit_max else other.max_name,
                    _add(self.per_recompute, other.per_recompute, weight),
                    _add(self.per_swap, other.per_swap, weight),
                    _add(self.per_start, other.per_start, weight))

    @property
    def unit_only(self) -> bool:
        """A constant plus per-unit coefficients: its sum over a partition's parts is fixed."""
        return not (self.ends_after or self.starts_after or self.per_shared or self.unit_max or self.decides)

    @property
    def decides(self) -> bool:
        """Whether its value depends on the units' memory decisions."""
        return any(self.per_recompute) or any(self.per_swap) or any(self.per_start)

    def scaled(self, weight: float) -> Term:
        return Term().plus(self, weight)

    def upper_bound(self) -> float:
        """No part's value exceeds this (every decision and cut at its costliest)."""
        return self._upper_bound

    @functools.cached_property
    def _upper_bound(self) -> float:  # computed once: every memory row of every configuration asks its members
        def top(values: tuple[float, ...]) -> float:
            return max((v for v in values if v > 0), default=0.0)
        return (self.constant + sum(v for v in self.per_unit if v > 0) + top(self.ends_after)
                + top(self.starts_after) + sum(v for v in self.per_shared if v > 0) + top(self.unit_max)
                + sum(v for v in self.per_recompute if v > 0) + sum(v for v in self.per_swap if v > 0)
                + sum(v for v in self.per_start if v > 0))

    def floor(self) -> Term:
        """The same term with each unit's decision at its cheapest (a lower bound of any decision; a
        region start's cost counts as none)."""
        return self._floor

    @functools.cached_property
    def _floor(self) -> Term:  # built once: a row's members are floored by several bounds
        if not self.decides:
            return self
        count = max(len(self.per_recompute), len(self.per_swap), len(self.per_start))
        cheapest = tuple(min(0.0, r, w) for r, w in zip(self.per_recompute or (0.0,) * count,
                                                         self.per_swap or (0.0,) * count))
        return Term(self.constant, _add(self.per_unit, cheapest, 1.0), self.ends_after, self.starts_after,
                    self.per_shared, self.unit_max, self.max_name, family=self.family)

    @functools.cached_property
    def unit_prefix(self) -> tuple[float, ...]:
        """Running sums of ``per_unit`` (prefix[i] = sum of the first i), for O(1) range sums."""
        running, total = [0.0], 0.0
        for value in self.per_unit:
            total += value
            running.append(total)
        return tuple(running)

    @functools.cached_property
    def arrays(self) -> tuple[np.ndarray | None, ...]:
        """For vectorised evaluation, as arrays (None where the term has none): ``unit_prefix``; per last unit
        what leaves after it (``ends_after``, 0 after the last unit); per first unit what comes in before
        it (``starts_after``, 0 before the first unit); ``per_shared``; ``unit_max``."""
        return (np.asarray(self.unit_prefix) if self.per_unit else None,
                np.append(self.ends_after, 0.0) if self.ends_after else None,
                np.concatenate(([0.0], self.starts_after)) if self.starts_after else None,
                np.asarray(self.per_shared) if self.per_shared else None,
                np.asarray(self.unit_max) if self.unit_max else None)

    def max_over(self, first: int, last: int) -> float:
        """max(unit_max[first..last]) in O(1) (a sparse table built on first use)."""
        level = (last - first + 1).bit_length() - 1
        table = self._max_table
        return float(max(table[level][first], table[level][last - (1 << level) + 1]))

    @functools.cached_property
    def _max_table(self) -> list[np.ndarray]:
        table = [np.asarray(self.unit_max, dtype=float)]
        width = 1
        while 2 * width <= len(self.unit_max):
            previous = table[-1]
            table.append(np.maximum(previous[:-width], previous[width:]))
            width *= 2
        return table


def _add(a: tuple[float, ...], b: tuple[float, ...], weight: float) -> tuple[float, ...]:
    if not b:
        return a
    scaled = b if weight == 1 else tuple(map(functools.partial(operator.mul, weight), b))
    if not a:
        return scaled
    if len(a) != len(b):
        raise ValueError(f"terms over {len(a)} and {len(b)} units cannot be added")
    return tuple(map(operator.add, a, scaled))  # map, not a generator: the search adds many long terms


class Reduce(str, Enum):
    SUM = "sum"
    MAX = "max"


@dataclass(frozen=True)
class Aggregate:
    """``weight x`` the sum or the maximum of its members' terms, each on its part."""

    name: str
    reduce: Reduce
    weight: float
    members: tuple[tuple[int, Term], ...]  # (part, term)


@dataclass(frozen=True)
class Drain:
    """``weight x`` the largest, over parts s, of: the ``flow`` terms summed over parts s..P-1, plus
    ``pace_weight x`` the largest ``pace`` term over parts s..P-1, plus the ``tail`` terms of part s.

    This is how long the step lasts after part s's last micro-batch enters its backward pass, when
    part s then does its own ``tail`` (the gradient all-reduce, overlapping the others' drain).
    """

    name: str
    weight: float
    flow: tuple[tuple[int, Term], ...]  # (part, term)
    pace_weight: float
    pace: tuple[tuple[int, Term], ...]
    tail: tuple[tuple[int, Term], ...]


Objective = tuple["Aggregate | Drain", ...]


@dataclass(frozen=True)
class MemoryRow:
    """What one slot's ranks hold at their peak: the sum of its members' terms, at most the budget.

    A slot holding several stages adds up each stage's own peak (exact for one stage per slot,
    an upper bound otherwise).
    """

    slot: int
    members: tuple[tuple[int, Term], ...]  # (part, term)
    moment: str = "compute"  # "compute" (forwards and backwards), "recompute" (a recomputed region's
    # backward), "backward" (a backward's end), "accumulate" (a backward adding into the gradients), "split"
    # (after a split backward's I: every W waiting), "step" (the optimizer step)


@dataclass(frozen=True)
class CapacityRow:
    """A node's host memory or NVMe: the sum of ``weight x member`` over its ranks, at most ``capacity_bytes``."""

    name: str
    capacity_bytes: int
    members: tuple[tuple[int, float, Term], ...]  # (part, weight: ranks or micro-batches, member)


BREAKDOWN = ("fwd_ms", "bwd_ms", "weight_grad_ms", "split_extra_ms", "send_ms", "allreduce_ms", "optimizer_ms",
             "swap_ms", "grad_bytes", "static_bytes", "activation_bytes", "swap_bytes", "recompute_bytes",
             "host_bytes", "nvme_bytes", "state_bytes", "step_bytes", "tied_bytes", "accumulate_bytes",
             "transient_bytes", "region_transient_bytes", "summing_transient_bytes", "split_kept_bytes",
             "weight_grad_working_bytes")
"""The per-part terms every evaluation reports (planner/search/evaluate.py: PartSummary)."""


@dataclass(frozen=True)
class CostModel:
    """One configuration's costs as data: per-part terms, the step as aggregates, memory per slot."""

    problem: PipelineProblem
    parts: tuple[dict[str, Term], ...]  # per part, the BREAKDOWN terms (and any the objective adds)
    objective: Objective
    shared_next_use: tuple[tuple[int, ...], ...] = field(repr=False, default=())
    given_memory: tuple[MemoryRow, ...] | None = field(repr=False, default=None)  # else built on first use
    given_capacity: tuple[CapacityRow, ...] | None = field(repr=False, default=None)  # else built on first use

    @functools.cached_property
    def memory(self) -> tuple[MemoryRow, ...]:
        """Every slot's memory rows (:func:`_memory_rows`), built when first asked for: a configuration the
        search skips by its lower bound never needs them."""
        return self.given_memory if self.given_memory is not None else _memory_rows(self.problem, self.parts)

    @functools.cached_property
    def compute_memory(self) -> tuple[MemoryRow, ...]:
        """The rows at the moment of the forwards and backwards (one a slot), what :func:`memory_floor` reads:
        taken from :attr:`memory` where that was built, else built alone (the search floors many
        configurations that then need no other row: most of a 50B GPT's on 16 V100s do not fit)."""
        if self.given_memory is not None or "memory" in self.__dict__:
            return tuple(row for row in self.memory if row.moment == "compute")
        return _memory_rows(self.problem, self.parts, compute_only=True)

    @functools.cached_property
    def floor_bytes(self) -> float:
        """:func:`memory_floor`, computed once."""
        return memory_floor(self)

    @functools.cached_property
    def capacity(self) -> tuple[CapacityRow, ...]:
        """Each node's host memory and NVMe rows (:func:`_capacity_rows`), built when first asked for."""
        return self.given_capacity if self.given_capacity is not None else _capacity_rows(self.problem, self.parts)

    @functools.cached_property
    def frugal_memory(self) -> tuple[MemoryRow, ...]:
        """The memory rows with every decision at its most frugal: no partition needs less."""
        return tuple(MemoryRow(row.slot, tuple((part, member.floor()) for part, member in row.members), row.moment)
                     for row in self.memory)

    @functools.cached_property
    def next_use_arrays(self) -> tuple[np.ndarray, ...]:
        """``shared_next_use`` as arrays."""
        return tuple(np.asarray(next_use) for next_use in self.shared_next_use)

    @property
    def decides(self) -> bool:
        """Whether the model has memory decisions besides the partition."""
        return self.problem.tiers.activations

    @property
    def num_units(self) -> int:
        return len(self.problem.units)

    @property
    def num_parts(self) -> int:
        return len(self.parts)


def cost_model(problem: PipelineProblem) -> CostModel:
    """The costs of ``problem``'s configuration, written as terms: the one place formulas live.

    Per micro-batch, for part s: forward F_s and backward B_s; the transfer c_s across its outgoing
    cut (the gradient returns in the same time, on the opposite link); a_s, what is left of the
    gradient all-reduce over the part's copies when the part's last backward ends (its buckets before
    the last run during that backward: the share ``_overlapped`` says), and then its optimizer step o_s.

    GPipe is a flow shop of identical micro-batches, forward through parts and links, then backward,
    so (exactly, as the simulator replays it; tests/unit/test_step_model.py):

        step = sum_s F_s + sum_s c_s + (M - 1) max(F_s, c_s)
               + max_s [ sum_{t>=s} (B_t + c_t) + (M - 1) max_{t>=s} (B_t, c_t) + a_s + o_s ]

    1F1B alternates forwards and backwards; its closed form (an approximation: the simulator gives
    the plan's step) takes one micro-batch's path plus M - 1 more at the pace of the slowest
    resource, where a part cannot start its next forward before its successor returned the
    backward of an earlier micro-batch (r_s = F_s + B_s + 2 c_{s-1}):

        step = sum_s F_s + sum_s c_s + (M - 1) max(F_s + B_s, c_s, r_s)
               + max_s [ sum_{t>=s} (B_t + c_t) + a_s + o_s ]

    Memory decisions (when the problem's tiers allow them):

    * recomputing unit i adds its forward to B_s and drops what its nodes save; a checkpoint region
      (a run of recomputed units within one block of RECOMPUTE_BLOCK_UNITS) keeps its first unit's
      inputs (``input_bytes``); while a region's backward runs, its activations exist again
      (counted as the part's largest block, recomputed or not, when recompute may be chosen);
    * swapping unit i moves what its nodes save to the host over the host link, w_s bytes per
      micro-batch: out after its forward, back one backward ahead of its own. The copies run on
      their own engine, so they cost time only where they are slower than the compute they hide
      behind: w_s is a resource of the pace (per micro-batch), and the first prefetch of the drain
      is exposed. Two micro-batches' swapped bytes are on the device at once (the one in its
      backward and the one prefetched; more where a split backward's W waits: ``swapped_resident``),
      the rest on the host;
    * the state mode (one per configuration) decides where the fp32 master weights and optimizer state live (divided by the
      part's copies under ZeRO-1) and what the step costs: on the GPU, its state traffic at memory
      bandwidth; on the host, the gradients down and the weights up over the host link (in the masters'
      dtype) and the update on the host's cores; on NVMe, also reading and writing the state over the
      NVMe link.

    Memory of stage t on part s: its weights, gradients, optimizer state and
    buffers (as its mode keeps them), its largest transient, one send buffer (and on gloo the receives of
    the next run, posted a run ahead: an input and a gradient's worth), two micro-batches' swapped bytes,
    and in-flight(t) x (kept saved activations + received inputs); on the last part the activations
    include what the loss keeps (added to the unit holding the graph's output in planner/search/problem.py).
    A split backward (ZB-H1) also holds, per micro-batch whose W waits after its I (``problem.waiting``),
    what I kept for W: the output gradients of the part's nodes that compute with weights (none on the
    first part, whose W is the whole backward).
    Other moments have rows of their own (:func:`_memory_rows`): a recomputed region's backward, where its
    activations exist again beside a node's working set in place of the largest transient (a language
    model's is the loss's, whose backward ran first); a backward's end, where a stage holding both uses of a
    tied weight sums their partial gradients with one micro-batch fewer in flight; and its optimizer step,
    which holds the model state and its worst bucket's buffers (``step_bytes``) but no activations. Each
    node's host memory and NVMe hold what its ranks' modes and swaps put there.
    """
    shared = _shared_terms(problem, problem.units)
    tiled = [_tiled_terms(problem, spatial) for spatial in problem.spatial]
    states: dict[int, dict[str, Term]] = {}  # the state terms per number of copies (hashing the units once each)
    average = _average_part(problem)
    alike: dict[tuple, dict[str, Term]] = {}  # parts whose terms come out the same share one dict of them
    parts = []
    for part in range(problem.num_parts):
        key = _part_key(problem, part)
        if key not in alike:
            alike[key] = _part_terms(problem, part, tiled[part] if part < len(tiled) else shared, states, average)
        parts.append(alike[key])
    return CostModel(problem, tuple(parts), _objective(problem, tuple(parts)), _next_use(problem))


def _part_key(problem: PipelineProblem, part: int) -> tuple:
    """Everything :func:`_part_terms` reads of ``part`` beyond what every part shares: two parts with equal keys
    have equal terms (a 16-part pipeline's middle parts on one node all do), which are then built once."""
    is_first, is_last = part == 0, part == problem.num_parts - 1
    tiled = part if part < len(problem.spatial) else -1
    return (tiled, is_first, is_last, len(problem.layout.part_ranks(part)),
            part in problem.schedule.stale_parts(problem.num_parts), problem.allreduce[part],
            None if is_last else problem.links[part], None if is_first else problem.links[part - 1])


def _shared_terms(problem: PipelineProblem, units: tuple[Unit, ...],
                  boundary: tuple[float, ...] | None = None) -> dict[str, Term]:
    """The terms every part has alike (per-unit sums over ``units``; ``boundary``: what crosses each cut,
    default the problem's), built once and shared by all parts, and by every configuration over the same
    units with the same activation tiers (:func:`_terms_over`)."""
    tiers = problem.tiers
    return _terms_over(units, problem.boundary_bytes if boundary is None else boundary, problem.shared,
                       tiers.recompute, tiers.swap, tiers.host_link.ms_per_byte)


@functools.lru_cache(maxsize=256)
def _terms_over(units: tuple[Unit, ...], crossing: tuple[float, ...], shared: tuple[SharedParam, ...],
                recompute: bool, swap: bool, host_ms_per_byte: float) -> dict[str, Term]:
    """:func:`_shared_terms`, cached: a search costs a thousand configurations over a few sets of units, and
    terms shared between them also share what they cache (their prefix sums and tables of maxima). Callers
    must not change the dict.
    """
    terms = {
        "fwd_ms": Term(per_unit=tuple(u.fwd_ms for u in units)),
        "bwd_ms": Term(per_unit=tuple(u.bwd_ms for u in units),
                       per_recompute=tuple(u.fwd_ms for u in units) if recompute else ()),
        "weight_grad_ms": Term(per_unit=tuple(u.weight_grad_ms for u in units)),  # a split backward's W
        "split_extra_ms": Term(per_unit=tuple(u.split_extra_ms for u in units)),  # its I and W beyond bwd_ms
        # what its I keeps for its W (the weighted nodes' output gradients), per micro-batch whose W waits
        "split_kept_bytes": Term(per_unit=tuple(float(u.split_kept_bytes) for u in units)),
        # and once its I ended, the working set of its W: the most a weighted node's W allocates, not the
        # largest transient (which may be the loss's, or a node's without weights)
        "weight_grad_working_bytes": Term(unit_max=tuple(float(u.weight_grad_working_bytes) for u in units),
                                          max_name="weight_grad_working"),
        "grad_bytes": Term(per_unit=tuple(float(u.grad_bytes) for u in units),
                           per_shared=tuple(float(p.grad_bytes) for p in shared)),
        "transient_bytes": Term(unit_max=tuple(float(u.transient_bytes) for u in units), max_name="transient"),
        "saved_bytes": Term(per_unit=tuple(float(u.activation_bytes) for u in units),
                            per_recompute=tuple(-float(u.offloadable_bytes) for u in units) if recompute else (),
                            per_swap=tuple(-float(u.offloadable_bytes) for u in units) if swap else (),
                            per_start=tuple(float(u.input_bytes) for u in units) if recompute else ()),
        # a tied parameter's users in one part: autograd holds each one's partial gradient until it sums them,
        # at the earliest user's backward: 2 more gradients' worth when two users share a part (the sum is
        # then added into, or becomes, the gradient counted in the state); none with one user a part. A
        # shared parameter (users in several units) counts 2 per user less 2 per part using it
        "tied_bytes": Term(per_unit=tuple(2.0 * (u.tied_grad_bytes + sum(shared[q].grad_bytes for q in u.shared))
                                          for u in units),
                           per_shared=tuple(-2.0 * p.grad_bytes for p in shared)),
        # a backward after a stage's first of the step holds each node's new weight gradients until they are
        # added into the stage's: its working set then, in place of transient_bytes
        "accumulate_bytes": Term(unit_max=tuple(float(u.accumulating_bytes) for u in units), max_name="accumulate"),
        "sent_bytes": Term(ends_after=tuple(float(b) for b in crossing)),
        "received_bytes": Term(starts_after=tuple(float(b) for b in crossing)),
        "swap_bytes": Term(per_swap=tuple(float(u.offloadable_bytes) for u in units) if swap else ()),
        # while a region's backward runs its activations exist again: at most its block's, counted for
        # the part's largest block whether or not it recomputes, so no rounding of the shares exceeds it
        "recompute_bytes": Term(unit_max=_block_bytes(units) if recompute else (), max_name="recomputed"),
        # and beside them a node's working set, not the loss's: its backward ran first (cost_models.loss)
        "region_transient_bytes": Term(unit_max=tuple(float(u.region_transient_bytes) for u in units),
                                       max_name="region_transient"),
        # where a backward sums tied weights' partial gradients (the earliest user's): that node's working set
        "summing_transient_bytes": Term(unit_max=tuple(float(u.summing_transient_bytes) for u in units),
                                        max_name="summing_transient"),
    }
    terms["swap_ms"] = terms["swap_bytes"].scaled(host_ms_per_byte)
    terms["compute_ms"] = terms["fwd_ms"].plus(terms["bwd_ms"])
    terms["activation_bytes"] = terms["saved_bytes"].plus(terms["received_bytes"])
    return {name: dataclasses.replace(term, family=name) for name, term in terms.items()}


def _tiled_terms(problem: PipelineProblem, spatial: SpatialPart) -> dict[str, Term]:
    """A spatial part's shared terms: the same formulas over the units as its slowest tile runs them (the
    values crossing its cuts as the largest tile holds them; their transfer times stay whole, as the
    receiving rank's link carries them); a unit that cannot be tiled weighs more than the budget in its
    static memory, so no partition puts it on that part (the ILP's memory row, the DP and the evaluator
    all read it)."""
    tiled = dict(_shared_terms(problem, spatial.units, spatial.boundary_bytes or None))  # (a cached dict)
    beyond = float(problem.mem_bytes + 1)
    untileable = Term(per_unit=tuple(0.0 if unit < spatial.tileable_units else beyond
                                     for unit in range(len(problem.units))))
    tiled["untileable_bytes"] = untileable
    return tiled


def _block_bytes(units: tuple) -> tuple[float, ...]:
    """Per unit, what its whole recompute block saves (the most a region in it rematerialises)."""
    blocks: dict[int, float] = {}
    for index, unit in enumerate(units):
        blocks[block_of(index)] = blocks.get(block_of(index), 0.0) + unit.offloadable_bytes
    return tuple(blocks[block_of(index)] for index in range(len(units)))


def _state_terms(problem: PipelineProblem, copies: int) -> dict[str, Term]:
    """In the problem's state mode, the model state on the device, on the host, on NVMe, and the
    optimizer step time of a part with ``copies`` copies (:func:`_state_terms_over`)."""
    return _state_terms_over(problem.units, problem.shared, problem.tiers, problem.backend, copies)


@functools.lru_cache(maxsize=256)
def _state_terms_over(units: tuple[Unit, ...], shared: tuple[SharedParam, ...], tiers: MemoryTiers, backend: str,
                      copies: int) -> dict[str, Term]:
    """:func:`_state_terms`, cached as :func:`_terms_over` is: what it reads of a configuration (its units,
    memory tiers, backend and a part's copies) a thousand configurations share in a few combinations (ResNet-152
    on 16 V100s: 1,182 configurations, whose state terms took 0.8 s of its 5.7 s of planning, 0.17 s cached).
    Callers must not change the dict."""
    def per_parameter(value: Callable[[Any], float]) -> Term:  # value(unit or shared parameter)
        return Term(per_unit=tuple(float(value(u)) for u in units),
                    per_shared=tuple(float(value(p)) for p in shared))

    terms = _mode_terms(tiers, tiers.state, copies, per_parameter,
                        max((u.largest_own_param_numel for u in units), default=0))
    return {**dict(zip(("state_bytes", "host_bytes", "nvme_bytes", "optimizer_ms"), terms)),
            "weight_bytes": per_parameter(lambda a: a.weight_bytes),
            "step_bytes": _step_term(units, shared, tiers, backend, copies),
            **_sent_gradient_terms(units, shared, tiers)}


def _sent_gradient_terms(units: tuple[Unit, ...], shared: tuple[SharedParam, ...],
                         tiers: MemoryTiers) -> dict[str, Term]:
    """Where a part sends each backward's gradients to the host (``grads_on_host``): what that adds to each
    backward, per micro-batch (each of its parameters' gradient cast to the masters' dtype, copied down and
    added to its sum on the host, in turn: runtime/stage_optimizer.py waits for each copy), and the gradients
    left on the device (the shared parameters', tied weights summed across parts there); else nothing."""
    if not tiers.state.grads_on_host:
        return {}
    per_param_ms = tiers.host_grad_bytes_per_param * tiers.host_link.ms_per_byte + tiers.host_sum_ms_per_param
    return {"grads_down_ms": Term(per_unit=tuple(u.param_numel * per_param_ms for u in units)),
            "grad_bytes": Term(per_shared=tuple(float(p.grad_bytes) for p in shared))}


def _step_term(units: tuple[Unit, ...], shared: tuple[SharedParam, ...], tiers: MemoryTiers, backend: str,
               copies: int) -> Term:
    """What a part's optimizer step allocates on the device beyond its model state, at its worst bucket
    (:func:`step_bucket_bytes_of`).

    A bucket holds at most a bucket's limit or one parameter (shard), whichever is larger: per unit, the
    bucket its largest parameter (or a shared one it uses, never sharded) may be in; the part's worst is its
    units' maximum. The limit is taken at the whole model's gradients (of a shard under ZeRO), which no part
    exceeds: the same limit as the runtime's where every part is below 8 MiB of gradients or above 512 MiB,
    above it between. It is an upper bound, which the ILP's memory rows keep: the runtime fills a bucket
    with whole parameters up to the limit, so its worst bucket may hold less; the assembled plan packs its
    stages' parameters as the runtime does (planner/stepped.py: the last stage of benchmarks/fidelity.py's
    step-peak plan, 1.2 MiB of bf16 gradients, packs 347,008 elements into its worst bucket where this
    bound counts 524,288). Not costed (empty) where the problem names no precision and optimizer."""
    bucket_bytes = step_bucket_bytes_of(tiers, backend, copies)
    if bucket_bytes is None:
        return Term()
    sharded = bool(tiers.state.zero_stage) and copies > 1
    share = 1.0 / copies if sharded else 1.0
    grad_bytes = share * (sum(u.grad_bytes for u in units) + sum(p.grad_bytes for p in shared))
    limit_numel = step_bucket_bytes(int(grad_bytes)) / tiers.precision.itemsize  # type: ignore[union-attr]

    def worst(numel: float) -> float:  # a bucket of one kind: shards where the part is sharded
        return bucket_bytes(numel, numel if sharded else 0.0)

    largest = [max((share * unit.largest_param_numel, *(shared[q].param_numel for q in unit.shared)))
               if unit.largest_param_numel or unit.shared else 0.0 for unit in units]
    return Term(unit_max=tuple(worst(max(limit_numel, numel)) if numel else 0.0 for numel in largest),
                max_name="step")


def step_bucket_bytes_of(tiers: MemoryTiers, backend: str, copies: int) -> Callable[[float, float], float] | None:
    """What one bucket of the optimizer step of a part with ``copies`` copies allocates on the device
    beyond its model state (cost_models.memory: step_transient_bytes; and ZeRO-1/2's all-gather of the
    bucket, zero_gather_bytes) in ``tiers``' state mode on ``backend``, as a function of the bucket's elements
    on this rank and, of those, the elements of sharded parameters (their shards). None where the tiers name no
    precision and optimizer (a bare problem)."""
    precision, optimizer, mode = tiers.precision, tiers.optimizer, tiers.state
    if precision is None or optimizer is None:
        return None
    sharded = bool(mode.zero_stage) and copies > 1
    off_device = mode.optimizer is not StateTier.GPU
    separate = precision.master_weights or sharded or off_device
    staging = ALL_GATHER_STAGING[backend]

    def bucket_bytes(numel: float, shard_numel: float) -> float:
        whole = numel - shard_numel  # ZeRO-1 frees a shard's whole gradient; ZeRO-2's hold the shard alone
        freed = whole + (copies * shard_numel if mode.zero_stage == 1 else shard_numel)
        step = step_transient_bytes(numel, precision, optimizer, separate_masters=separate,
                                    steps_on_device=not off_device, freed_numel=freed)
        gathered = (zero_gather_bytes(shard_numel, precision, copies, masters_off_device=off_device,
                                      freed_numel=freed, staging=staging)
                    if sharded and mode.zero_stage in (1, 2) and shard_numel else 0.0)
        return max(step, gathered)

    return bucket_bytes


def _mode_terms(tiers: MemoryTiers, mode: StateMode, copies: int,
                per_parameter: Callable[[Callable[[Any], float]], Term],
                largest_param_numel: int = 0) -> tuple[Term, Term, Term, Term]:
    """One mode's (device state bytes, host bytes, NVMe bytes, optimizer step ms) of a part (of a model whose
    largest parameter a unit owns has ``largest_param_numel`` elements)."""
    share = 1.0 / copies if mode.zero_stage else 1.0
    spared = 1.0 - share if mode.zero_stage == 3 else 0.0  # ZeRO-3: of its layers' weights and gradients, a shard

    def layered(a: Any) -> float:
        return a.layered_weight_bytes + a.layered_grad_bytes if isinstance(a, Unit) else 0.0

    if mode.optimizer is StateTier.GPU:
        return (per_parameter(lambda a: a.state_bytes - a.optimizer_bytes + share * a.optimizer_bytes
                              - spared * layered(a)),
                Term(), Term(),
                per_parameter(lambda a: share * tiers.device_step_ms_per_byte
                              * (2 * a.weight_bytes + a.grad_bytes + 2 * a.optimizer_bytes) if tiers.device_step is None
                              else tiers.device_step.ms(a.param_tensors, share * a.param_numel)))  # a shard of each
    link, disk = tiers.host_link, tiers.nvme_link
    sent = mode.grads_on_host  # (then a unit's own gradients are on the host: a shared parameter's stay)

    def hosted(a: Any) -> float:  # ZeRO-3's weight shards on the host (ZeRO-Infinity's parameter offload)
        return share * a.layered_weight_bytes if mode.params_on_host and isinstance(a, Unit) else 0.0

    device = per_parameter(lambda a: a.state_bytes - a.optimizer_bytes - (a.grad_bytes if sent and isinstance(a, Unit)
                                                                          else 0) - spared * layered(a) - hosted(a))
    if sent:  # each gradient's cast to the masters' dtype, on the device before it goes down: at most the
        # model's largest sent parameter's (a constant: the part's largest would be a second maximum over units)
        device = device.plus(Term(constant=largest_param_numel * tiers.host_grad_bytes_per_param))
    host_grads = per_parameter(lambda a: share * a.param_numel * tiers.host_grad_bytes_per_param + hosted(a))
    # the gradient down and the weight up cross the link in the masters' dtype (runtime/stage_optimizer.py
    # casts on the GPU: casting on the host would be a pass over every parameter on the CPU); gradients sent
    # each backward are down before the step
    link_ms_per_param = (1 if sent else 2) * tiers.host_grad_bytes_per_param * link.ms_per_byte
    def host_step_ms(a: Any) -> float:  # (per parameter at the host's rate, where it was not measured)
        if tiers.host_step is None:
            return share * a.param_numel * tiers.host_step_ms_per_param
        return tiers.host_step.ms(a.param_tensors, share * a.param_numel)
    on_host = per_parameter(lambda a: share * a.param_numel * link_ms_per_param + host_step_ms(a))
    on_host = on_host.plus(Term(constant=2 * link.fixed_ms))
    # off the device the step updates a master copy: fp32/fp64 training has none in optimizer_bytes
    optimizer_state = per_parameter(lambda a: share * (a.optimizer_bytes
                                                       + a.param_numel * tiers.host_master_bytes_per_param))
    if mode.optimizer is StateTier.HOST:
        return device, host_grads.plus(optimizer_state), Term(), on_host
    paging = optimizer_state.scaled(2 * disk.ms_per_byte).plus(Term(constant=2 * disk.fixed_ms))
    return device, host_grads, optimizer_state, on_host.plus(paging)


def _average_part(problem: PipelineProblem) -> tuple[float, float]:
    """(gradient bytes, backward ms per micro-batch) of the configuration's average part."""
    parts = problem.num_parts
    grad_bytes = sum(unit.grad_bytes for unit in problem.units) + sum(p.grad_bytes for p in problem.shared)
    return grad_bytes / parts, sum(unit.bwd_ms for unit in problem.units) / parts


def _overlapped(problem: PipelineProblem, part: int, average: tuple[float, float]) -> float:
    """The share of a part's all-reduce that the runtime hides in its last backward (DDP's overlap:
    StagePrediction.allreduce_overlap, which the simulator replays), taken at the configuration's average
    part (a constant, so the objective stays linear in the cuts): the buckets before the last, and no more
    than that backward lasts; 0 under ZeRO-2/3, on WPipe's stashed versions, after ZB-H1's W and on gloo."""
    if (problem.tiers.state.zero_stage >= 2 or problem.schedule.splits_backward
            or part in problem.schedule.stale_parts(problem.num_parts)):
        return 0.0
    grad_bytes, backward_ms = average
    allreduce_ms = problem.allreduce[part].ms(grad_bytes)
    return min(hidden_share(grad_bytes, problem.backend), backward_ms / allreduce_ms) if allreduce_ms > 0 else 0.0


def _part_terms(problem: PipelineProblem, part: int, shared: dict[str, Term],
                states: dict[int, dict[str, Term]], average: tuple[float, float]) -> dict[str, Term]:
    """Part ``part``'s terms: held all step, per micro-batch, its link, all-reduce and step times (``states``
    holds the state terms by number of copies)."""
    is_first, is_last = part == 0, part == problem.num_parts - 1
    boundary = problem.boundary_bytes
    allreduce = problem.allreduce[part]
    copies = len(problem.layout.part_ranks(part))
    layered = problem.tiers.state.zero_stage == 3 and copies > 1
    if layered:  # ZeRO-3: its layers' gathers and reductions in every forward and backward
        up = problem.tiers.host_link if problem.tiers.state.params_on_host else None  # shards copied up first
        shared = {**shared, **_gathering_terms(problem.units, problem.shared, allreduce, up, copies, problem.backend,
                                               problem.tiers.recompute, shared["fwd_ms"], shared["bwd_ms"])}
    terms: dict[str, Term] = {name: shared[name] for name in (
        "fwd_ms", "bwd_ms", "weight_grad_ms", "split_extra_ms", "split_kept_bytes", "weight_grad_working_bytes",
        "compute_ms", "grad_bytes", "swap_bytes", "swap_ms", "recompute_bytes", "tied_bytes", "accumulate_bytes",
        "transient_bytes", "region_transient_bytes", "summing_transient_bytes")}
    if is_first:  # its inputs are data, carrying no gradient: a split backward's I has nothing to do, W all of it
        terms["weight_grad_ms"] = dataclasses.replace(shared["bwd_ms"], family="weight_grad_ms")
        terms["split_extra_ms"] = terms["split_kept_bytes"] = Term()  # (the runtime's W there is one whole backward)
    if copies not in states:
        states[copies] = _state_terms(problem, copies)
    state = states[copies]
    if "grads_down_ms" in state:  # each backward sends its gradients to the host (W's, where it is split)
        for name in ("bwd_ms", "compute_ms", "weight_grad_ms"):
            terms[name] = dataclasses.replace(terms[name].plus(state["grads_down_ms"]), family=name)
        terms["grad_bytes"] = dataclasses.replace(state["grad_bytes"], family="grad_bytes")
    working = Term() if is_last else shared["sent_bytes"]  # + the transient (below)
    ahead = float(RECEIVES_POSTED_AHEAD[problem.backend])  # the next run's receives, posted early:
    if ahead and not is_first:  # an input from the part before
        working = working.plus(shared["received_bytes"], ahead)
    if ahead and not is_last:  # the gradient of what it sent
        working = working.plus(shared["sent_bytes"], ahead)
    if "untileable_bytes" in shared:
        working = working.plus(shared["untileable_bytes"])
    if layered:
        working = working.plus(shared["gathered_bytes"])
    terms["state_bytes"] = state["state_bytes"]
    if part in problem.schedule.stale_parts(problem.num_parts):  # WPipe's stashed weight versions
        terms["state_bytes"] = terms["state_bytes"].plus(state["weight_bytes"], float(STASHED_WEIGHT_VERSIONS))
    terms["kept_bytes"] = terms["state_bytes"].plus(working)  # + one send buffer
    terms["static_bytes"] = terms["kept_bytes"].plus(shared["transient_bytes"])
    terms.update({name: state[name] for name in ("host_bytes", "nvme_bytes", "optimizer_ms", "step_bytes")})
    if problem.tiers.state.zero_stage in (1, 2) and copies > 1:  # the updated shards are all-gathered into every copy:
        gather = Term(constant=allreduce.fixed_ms * ALL_GATHER_SHARE).plus(state["weight_bytes"],
                                                                           allreduce.ms_per_byte * ALL_GATHER_SHARE)
        terms["optimizer_ms"] = terms["optimizer_ms"].plus(gather)  # half a ring all-reduce of the weights
    terms["activation_bytes"] = shared["saved_bytes" if is_first else "activation_bytes"]  # + received inputs
    terms["send_ms"] = Term(ends_after=() if is_last else tuple(problem.links[part].ms(b) for b in boundary))
    summed = shared["whole_grad_bytes" if layered else "grad_bytes"]  # (ZeRO-3's layers reduced theirs already)
    terms["allreduce_ms"] = dataclasses.replace(
        Term(constant=allreduce.fixed_ms).plus(summed, allreduce.ms_per_byte), family="allreduce_ms")
    hidden = _overlapped(problem, part, average)  # the share the last backward hides
    terms["allreduce_tail_ms"] = dataclasses.replace(Term(constant=allreduce.fixed_ms).plus(
        summed, allreduce.ms_per_byte * (1 - hidden)), family="allreduce_tail_ms")
    if problem.schedule is ScheduleKind.ONE_F_ONE_B and not is_first:
        round_trip = tuple(2 * problem.links[part - 1].ms(b) for b in boundary)
        terms["round_trip_ms"] = shared["compute_ms"].plus(Term(starts_after=round_trip))
    return terms


def gathered_layer_copies(copies: int, backend: str, ahead: bool) -> float:
    """What a ZeRO-3 part with ``copies`` copies holds of its largest gather group's weights at the worst moment, in
    copies of them. A group's all-gather holds its output (one) only until the weights are filled from it
    (runtime/sharding.py), in the group's forward and again in its backward: two at the fill, with its input, this
    rank's row (1 / copies), where ``backend`` still holds that (:data:`cost_models.comm.GATHER_ROW_HELD`); at its
    backward's end the weights and their whole gradient (two), the weights freed before the gradient is packed
    into the sum's table (two again). Besides: the table ``backend`` keeps between sums
    (:data:`cost_models.comm.KEPT_SUM_TABLE`), and with each group's gather started ``ahead``
    (:data:`cost_models.comm.GATHERS_AHEAD`), that gather's output and row."""
    row = 1.0 / copies
    return 2.0 + (row if GATHER_ROW_HELD[backend] else 0.0) + KEPT_SUM_TABLE[backend] + ((1.0 + row) if ahead else 0.0)


def layer_collective_fixed_ms(allreduce: LinearCost, up: LinearCost | None, backend: str) -> tuple[float, float]:
    """The fixed time (bytes apart) of one ZeRO-3 gather over ``allreduce``'s link, half a ring all-reduce's (with
    the shards on the host, plus a message up ``up``, the host link), and of one gradient reduce-scatter."""
    gather_ms = allreduce.fixed_ms * ALL_GATHER_SHARE + (up.fixed_ms if up is not None else 0.0)
    return gather_ms, LAYER_REDUCE_SHARE[backend] * allreduce.fixed_ms


def layer_gather_ms_per_byte(allreduce: LinearCost) -> float:
    """What a ZeRO-3 gather over ``allreduce``'s link takes per byte of the weights it gathers (half a ring
    all-reduce's)."""
    return allreduce.ms_per_byte * ALL_GATHER_SHARE


@functools.lru_cache(maxsize=64)
def _gathering_terms(units: tuple[Unit, ...], shared: tuple[SharedParam, ...], allreduce: LinearCost,
                     up: LinearCost | None, copies: int, backend: str, recompute: bool, fwd_ms: Term,
                     bwd_ms: Term) -> dict[str, Term]:
    """A ZeRO-3 part's shared terms ``fwd_ms`` and ``bwd_ms`` with its layers' collectives (runtime/
    layer_gathers.py) over ``allreduce``'s link: each module call all-gathers its weights before its forward,
    again before its backward (and before a recomputed forward), each half a ring all-reduce (with the shards on
    the host, each gather first copies this rank's up over ``up``, the host link, a message per call), and
    reduce-scatters its gradients after its backward (:data:`cost_models.comm.LAYER_REDUCE_SHARE` of a ring
    all-reduce: half on NCCL, a whole one on gloo); its largest layer's gathered weights and their gradient beside
    the rest (:func:`gathered_layer_copies`); the gradients it holds (its layers' shards, the rest whole); and those
    the step still sums whole (the ones no layer owns)."""
    gather_ms, reduce_ms = layer_collective_fixed_ms(allreduce, up, backend)
    gather = tuple(u.layered_calls * gather_ms + u.layered_weight_bytes * layer_gather_ms_per_byte(allreduce)
                   for u in units)
    if up is not None:
        gather = tuple(g + u.layered_weight_bytes / copies * up.ms_per_byte for g, u in zip(gather, units))
    reduce = LAYER_REDUCE_SHARE[backend]
    scatter = tuple(u.layered_calls * reduce_ms + reduce * u.layered_grad_bytes * allreduce.ms_per_byte
                    for u in units)
    fwd_ms = fwd_ms.plus(Term(per_unit=gather))
    bwd_ms = bwd_ms.plus(Term(per_unit=tuple(g + r for g, r in zip(gather, scatter)),
                                       per_recompute=gather if recompute else ()))
    largest = max((u.largest_layer_bytes for u in units), default=0)
    terms = {"fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "compute_ms": fwd_ms.plus(bwd_ms),
             "gathered_bytes": Term(constant=gathered_layer_copies(copies, backend, GATHERS_AHEAD[backend]) * largest),
             "whole_grad_bytes": Term(per_unit=tuple(float(u.grad_bytes - u.layered_grad_bytes) for u in units),
                                      per_shared=tuple(float(p.grad_bytes) for p in shared)),
             # the gradients it holds from its first backward to its step: the layers' shards, the rest whole
             "grad_bytes": Term(per_unit=tuple(u.grad_bytes - (1 - 1 / copies) * u.layered_grad_bytes for u in units),
                                per_shared=tuple(float(p.grad_bytes) for p in shared))}
    return {name: dataclasses.replace(term, family=name) for name, term in terms.items()}


def _objective(problem: PipelineProblem, parts: tuple[dict[str, Term], ...]) -> Objective:
    if not problem.schedule.closed_form:
        return _replayed_objective(problem, parts)
    every = range(problem.num_parts)
    sends = tuple((p, parts[p]["send_ms"]) for p in range(problem.num_parts - 1))
    swaps = tuple((p, parts[p]["swap_ms"]) for p in every) if problem.tiers.swap else ()
    repeats = float(problem.num_microbatches - 1)
    if problem.schedule is ScheduleKind.GPIPE:
        pace = tuple((p, parts[p]["fwd_ms"]) for p in every) + sends + swaps
        drain_pace = tuple((p, parts[p]["bwd_ms"]) for p in every) + sends + swaps
    else:  # 1F1B: the slowest of a part's compute, a link, its swaps, and a round trip through the next part
        pace = tuple((p, parts[p]["compute_ms"]) for p in every) + swaps
        for p in range(problem.num_parts - 1):
            pace += ((p, parts[p]["send_ms"]), (p + 1, parts[p + 1]["round_trip_ms"]))
        drain_pace = ()
    tails = tuple((p, parts[p][name]) for p in every for name in ("allreduce_tail_ms", "optimizer_ms"))
    return (
        Aggregate("forward", Reduce.SUM, 1.0, tuple((p, parts[p]["fwd_ms"]) for p in every)),
        Aggregate("forward_transfers", Reduce.SUM, 1.0, sends),
        Aggregate("bottleneck", Reduce.MAX, repeats, pace),
        Drain("backward", 1.0, tuple((p, parts[p]["bwd_ms"]) for p in every) + sends + swaps,
              repeats if drain_pace else 0.0, drain_pace, tails),
    )


def _replayed_objective(problem: PipelineProblem, parts: tuple[dict[str, Term], ...]) -> Objective:
    """The step of a family without a closed form (interleaved 1F1B, GEMS-MASTER, ZB-H1), scaled by its
    own programs: replayed on balanced parts (planner/schedules/balanced.py) they take
    ``rank_work - 1 + path_parts`` part-times, so here

        step = (rank_work - 1) max_s(C_s, c_s, w_s) + path_parts / P x sum_s C_s + 2 sum_s c_s + k max_s (a_s + o_s)

    with C_s = F_s + B_s (its W included; a split backward's extra too, split_extra_ms), c_s its link and w_s
    its swaps per micro-batch (the first micro-batch crosses every cut forward and back, however many parts
    a rank holds), and k the most stages a slot holds (their all-reduces and optimizer steps follow each
    other): exact for balanced parts with free transfers, an estimate otherwise (the simulator gives the
    plan's step, and the search compares the families' best plans on it: planner/assemble.py).
    """
    balanced = problem.balanced
    if balanced is None:
        raise ValueError(f"{problem.schedule.value} is costed from its programs replayed on balanced parts; "
                         f"give the problem's balanced step (planner/schedules/balanced.py)")
    every = range(problem.num_parts)
    along = balanced.path_parts / problem.num_parts
    sends = tuple((p, parts[p]["send_ms"]) for p in range(problem.num_parts - 1))
    swaps = tuple((p, parts[p]["swap_ms"]) for p in every) if problem.tiers.swap else ()
    split = problem.schedule.splits_backward
    compute = tuple((p, parts[p]["compute_ms"].plus(parts[p]["split_extra_ms"]) if split else parts[p]["compute_ms"])
                    for p in every)
    return (
        Aggregate("path", Reduce.SUM, along, compute),
        Aggregate("path_transfers", Reduce.SUM, 2.0, sends),
        Aggregate("bottleneck", Reduce.MAX, float(balanced.rank_work - 1), compute + sends + swaps),
        Aggregate("tail", Reduce.MAX, float(max(len(problem.layout.stages_on_slot(slot))
                                                for slot in range(problem.layout.num_slots))),
                  tuple((p, parts[p]["allreduce_tail_ms"].plus(parts[p]["optimizer_ms"])) for p in every)),
    )


def _memory_rows(problem: PipelineProblem, parts: tuple[dict[str, Term], ...],
                 compute_only: bool = False) -> tuple[MemoryRow, ...]:
    """Per slot, what it holds at the peak of its forwards and backwards (its largest transient, which for
    a language model is the loss's); in the backward of a recomputed region, whose activations exist again
    beside a node's working set (the loss's is gone by then); at the end of a backward, where
    tied weights' partial gradients are summed after the micro-batch's activations went (one micro-batch
    fewer in flight); at the start of each of its stages' backwards that add into its gradients (not the
    step's first, which makes them): the largest node's new weight gradient, with the micro-batches the stage
    holds then (``problem.accumulating``); where a stage splits its backward (ZB-H1), once an I ended: every
    micro-batch whose W waits holds what its I kept (``split_kept_bytes``) beside a W's working set (the most a
    weighted node's W allocates) in place of the largest transient, and the forwards' and I's starts hold the largest
    transient beside the W waiting then (``problem.waiting_at_transient``: one fewer in ZB-H1's programs); and
    at each of its stages' optimizer steps: that stage's model state and step buffers,
    the slot's other stages' static bytes, and no activations but those of forwards a stale-weight (WPipe)
    stage runs ahead of the step (counted as all its micro-batches in flight: an upper bound). A slot running the
    first part and the last holds one copy of a weight both use whatever the cuts (:func:`_held_twice`). With
    ``compute_only``, the rows at the moment of the forwards and backwards alone (one a slot)."""
    layout = problem.layout
    stale = problem.schedule.stale_parts(problem.num_parts)
    rows = []
    for slot in range(layout.num_slots):
        static: list[tuple[int, Term]] = []
        held: list[tuple[int, Term]] = []  # activations, and a recomputed region's while its backward runs
        summing: list[tuple[int, Term]] = []  # at a backward's end: tied gradients, one micro-batch fewer held,
        # the working set of the node summing them (the earliest user's backward: the others' are gone)
        computing: list[tuple[int, Term]] = []  # at the largest transient (the loss's): no region rematerialised
        recomputing: list[tuple[int, Term]] = []  # in a recomputed region's backward: a node's working set
        splitting: list[tuple[int, Term]] = []  # once a split backward's I ended: every W waiting, a node's
        # working set in place of the largest transient
        tied = any(parts[layout.part(stage)]["tied_bytes"].upper_bound() > 0 for stage in layout.stages_on_slot(slot))
        for stage in layout.stages_on_slot(slot):
            part = layout.part(stage)
            terms = parts[part]
            activations = terms["activation_bytes"].scaled(problem.in_flight[stage])
            if problem.tiers.swap:
                resident = problem.swapped_resident[stage] if problem.swapped_resident else 2
                activations = activations.plus(terms["swap_bytes"], float(resident))
            computing += [(part, terms["static_bytes"]), (part, activations)]
            waiting = problem.waiting[stage] if problem.waiting and part > 0 else 0  # (the first part's W is
            # its whole backward, the loss's too on one part: it keeps nothing and its transient stays)
            if waiting:  # the largest transient beside the W waiting when an F or an I starts
                computing.append((part, terms["split_kept_bytes"].scaled(float(problem.waiting_at_transient[stage]))))
            if compute_only:
                continue
            if waiting:
                splitting += [(part, terms["kept_bytes"].plus(terms["split_kept_bytes"], float(waiting))),
                              (part, terms["weight_grad_working_bytes"]),  # once an I ended: a W's working set
                              (part, activations)]
                activations = activations.plus(terms["split_kept_bytes"], float(waiting))  # in the rows below
            else:
                splitting += [(part, terms["static_bytes"]), (part, activations)]
            if problem.tiers.recompute:
                working = terms["kept_bytes"].plus(terms["region_transient_bytes"])  # a node's, the loss's gone
                activations = activations.plus(terms["recompute_bytes"])
                recomputing += [(part, working), (part, activations)]
            static.append((part, terms["static_bytes"]))
            held.append((part, activations))
            if tied:  # (its row is written only where a stage of the slot may sum tied gradients)
                summed_by = terms["kept_bytes"].plus(terms["summing_transient_bytes"])  # the earliest user's node
                summing += [(part, summed_by.plus(terms["tied_bytes"])),
                            (part, activations.plus(terms["activation_bytes"], -1.0))]
        rows.append(MemoryRow(slot, tuple(computing)))
        if compute_only:
            continue
        if problem.waiting and any(problem.waiting[stage] and layout.part(stage) > 0
                                   for stage in layout.stages_on_slot(slot)):
            rows.append(MemoryRow(slot, tuple(splitting), "split"))
        if recomputing:
            rows.append(MemoryRow(slot, tuple(recomputing), "recompute"))
        if tied:
            rows.append(MemoryRow(slot, tuple(summing), "backward"))
        for index, stage in enumerate(layout.stages_on_slot(slot)):
            count = problem.accumulating[stage] if problem.accumulating else 0
            part = layout.part(stage)
            if not (count and parts[part]["accumulate_bytes"].upper_bound() > 0):
                continue
            members: list[tuple[int, Term]] = []
            for other, ((at, kept), (_, activations)) in enumerate(zip(static, held)):
                if other == index:  # the micro-batches it holds then, and its working set in place of the transient
                    activations = activations.plus(parts[at]["activation_bytes"],
                                                   float(count - problem.in_flight[stage]))
                    kept = parts[at]["kept_bytes"]
                    members.append((at, parts[at]["accumulate_bytes"]))
                members += [(at, kept), (at, activations)]
            rows.append(MemoryRow(slot, tuple(members), "accumulate"))
        ahead = tuple((part, activations) for part, activations in held if part in stale)
        for index, (part, _) in enumerate(static):
            step = parts[part]["step_bytes"]
            if step.upper_bound() > 0:  # the other stages as the simulator holds them all step: recompute too
                others = tuple(member for other, (at, term) in enumerate(static) if other != index
                               for member in ((at, term), (at, parts[at]["recompute_bytes"])))
                stepping = (part, parts[part]["state_bytes"].plus(step))
                rows.append(MemoryRow(slot, (stepping, *others, *ahead), "step"))
    twice = _held_twice(problem, parts)
    return tuple(MemoryRow(row.slot, (*row.members, (0, Term(constant=-twice[row.slot]))), row.moment)
                 if row.slot in twice else row for row in rows)


def _held_twice(problem: PipelineProblem, parts: tuple[dict[str, Term], ...]) -> dict[int, float]:
    """Per slot running both the first part and the last, what its rows count twice of the shared parameters both
    use whatever the cuts (those the first unit and the last use: a GPT's embedding tied to its head): one copy's
    state, as the parts hold it (the lesser), since a rank keeps one tensor (runtime/stages.py: local_stages).
    GEMS-MASTER's ranks each run the first part of one model copy and the last of the other."""
    last = problem.num_parts - 1
    both = set(problem.units[0].shared) & set(problem.units[-1].shared) if last > 0 else set()
    if not both:
        return {}
    copy_bytes = copy_state_bytes([terms["state_bytes"].per_shared for terms in parts], (0, last), both)
    layout = problem.layout
    return {slot: copy_bytes for slot in range(layout.num_slots)
            if {0, last} <= {layout.part(stage) for stage in layout.stages_on_slot(slot)}}


def _capacity_rows(problem: PipelineProblem, parts: tuple[dict[str, Term], ...]) -> tuple[CapacityRow, ...]:
    """Per node, its host memory (optimizer state, host gradients, swapped activations) and its NVMe."""
    tiers, layout = problem.tiers, problem.layout
    if not (tiers.activations or tiers.state.optimizer is not StateTier.GPU):
        return ()
    ranks: dict[tuple[int, int], float] = {}  # (node, part) -> ranks of the part on the node
    swapped: dict[tuple[int, int], float] = {}  # (node, part) -> micro-batches swapped there at once
    for stage in range(layout.num_stages):
        part = layout.part(stage)
        for replica in range(layout.data_parallel):
            for rank in layout.ranks_of(stage, replica):
                key = (rank // tiers.gpus_per_node, part)
                ranks[key] = ranks.get(key, 0.0) + 1.0
                swapped[key] = swapped.get(key, 0.0) + problem.in_flight[stage]
    rows = []
    for node in sorted({node for node, _ in ranks}):
        host = [(part, count, parts[part]["host_bytes"]) for (n, part), count in sorted(ranks.items()) if n == node]
        if tiers.swap:
            host += [(part, count, parts[part]["swap_bytes"]) for (n, part), count in sorted(swapped.items())
                     if n == node]
        disk = [(part, count, parts[part]["nvme_bytes"]) for (n, part), count in sorted(ranks.items()) if n == node]
        rows += [CapacityRow(f"host_memory_node_{node}", tiers.host_mem_bytes, tuple(host)),
                 CapacityRow(f"nvme_node_{node}", tiers.nvme_bytes, tuple(disk))]
    return tuple(rows)


def _next_use(problem: PipelineProblem) -> tuple[tuple[int, ...], ...]:
    """Per shared parameter, for every unit f, the first unit at or after f using it (U if none)."""
    count = len(problem.units)
    result = []
    for q in range(len(problem.shared)):
        following = [count] * (count + 1)
        for index in range(count - 1, -1, -1):
            following[index] = index if q in problem.units[index].shared else following[index + 1]
        result.append(tuple(following))
    return tuple(result)


def fixed_sum(aggregate: Aggregate, num_parts: int) -> float | None:
    """The (unweighted) value of a sum no partition changes (one unit-only term over every part), else None.

    Such a sum (the total compute) is a constant of the ILP and no label of the DP.
    """
    every_part = sorted(part for part, _ in aggregate.members) == list(range(num_parts))
    if aggregate.reduce is not Reduce.SUM or not every_part:
        return None
    terms = [term for _, term in aggregate.members]
    first = terms[0]
    if not all(isinstance(t, Term) and t.unit_only and t.per_unit == first.per_unit
               and t.constant == first.constant for t in terms):
        return None
    return first.unit_prefix[-1] + num_parts * first.constant


def lower_bound(costs: CostModel) -> float:
    """A step time no partition can beat, from the objective alone (every coefficient is >= 0).

    A fixed sum counts in full, other sums at least their constants; a maximum is at least the
    largest member constant and, over one unit-only term on every part, at least the larger of
    its average part and its largest unit; a drain at least its value from part 0 so bounded, and
    at least its average over the parts (every part's tail, its own pace, and the whole flow once,
    over P).
    Every member counts at its floor (each decision at its cheapest), so the bound holds for every
    memory decision too.
    """
    def floors(members: tuple[tuple[int, Term], ...]) -> tuple[tuple[int, Term], ...]:
        return tuple((part, _units_floor(member.floor())) for part, member in members)

    total = 0.0
    for piece in costs.objective:
        if isinstance(piece, Drain):
            flow = _sum_lower_bound(Aggregate(piece.name, Reduce.SUM, 1.0, floors(piece.flow)), costs.num_parts)
            pace = Aggregate(piece.name, Reduce.MAX, 1.0, floors(piece.pace))
            tail = Aggregate(piece.name, Reduce.SUM, 1.0, floors(piece.tail))
            first_tail = sum(term.constant for part, term in tail.members if part == 0)
            # The drain from part 0, or the average of the drains from every part (each at least its
            # own tail and pace, the first at least the whole flow): the average carries every tail.
            whole = flow + first_tail + piece.pace_weight * _aggregate_lower_bound(pace, costs.num_parts)
            paces = max(_family_sums(pace, costs.num_parts), default=0.0)
            average = (flow + piece.pace_weight * paces + _sum_lower_bound(tail, costs.num_parts)) / costs.num_parts
            total += piece.weight * max(whole, average)
        else:
            total += piece.weight * _aggregate_lower_bound(
                Aggregate(piece.name, piece.reduce, 1.0, floors(piece.members)), costs.num_parts)
    return total


def _units_floor(term: Term) -> Term:
    """``term`` less what its cuts, shared parameters and unit maximum add, where none of that can be
    negative: a unit-only lower bound of it."""
    if term.unit_only or min((*term.ends_after, *term.starts_after, *term.per_shared, *term.unit_max),
                             default=0.0) < 0:
        return term
    return Term(term.constant, term.per_unit, family=term.family)


def _aggregate_lower_bound(aggregate: Aggregate, num_parts: int) -> float:
    if not aggregate.members:
        return 0.0
    if aggregate.reduce is Reduce.SUM:
        return _sum_lower_bound(aggregate, num_parts)
    return max(_max_lower_bound(aggregate, num_parts), max(term.constant for _, term in aggregate.members))


def _sum_lower_bound(aggregate: Aggregate, num_parts: int) -> float:
    """Constants, plus every family of one unit-only term summed over all parts (which no cut changes)."""
    return sum(term.constant for _, term in aggregate.members) + sum(_family_sums(aggregate, num_parts))


def _family_sums(aggregate: Aggregate, num_parts: int) -> list[float]:
    """For each family of unit-only terms that every part has, the least its sum over the parts (less
    their constants) can be, whatever the cuts."""
    return [family.sum_bound() for family in _families(aggregate, num_parts)]


@dataclass(frozen=True)
class _Family:
    """One kind of unit-only term on every part: ``first`` is part 0's per-unit coefficients, ``second``
    part 1's where it differs from the rest too (parts 0 and 1 on tiles of their own, now-dl's two spatial
    stages), ``rest`` every other part's (alike); or ``cheapest`` each unit's least coefficient when parts
    differ more."""

    constant: float  # the least constant over the parts
    num_parts: int
    first: tuple[float, ...]
    rest: tuple[float, ...] | None = None  # None: every part has ``first``
    cheapest: tuple[float, ...] | None = None  # set when the parts differ beyond parts 0 and 1
    second: tuple[float, ...] | None = None  # part 1's, where it differs from ``rest`` (then num_parts >= 3)

    def _splits(self) -> list[tuple[float, float, float, float]]:
        """For every cut after the leading parts (units 0..k on part 0, or on parts 0 and 1; k < U - 1): (the
        least their largest sum can be, the least their total can be, the other parts' sum, the largest unit
        after the cut). With two leading parts, part 1 may be empty here (a relaxation: the bound stays below
        every plan); part 0's sum rises with its cut and part 1's falls, so the best first cut for each k is
        found by bisection (every coefficient >= 0)."""
        assert self.rest is not None
        count = len(self.first)
        suffix_max = [0.0] * (count + 1)
        for unit in range(count - 1, -1, -1):
            suffix_max[unit] = max(self.rest[unit], suffix_max[unit + 1])
        first = list(itertools.accumulate(self.first))  # first[k]: part 0 = units 0..k
        total, done = sum(self.rest), list(itertools.accumulate(self.rest))
        if self.second is None:
            return [(first[k], first[k], total - done[k], suffix_max[k + 1]) for k in range(count - 1)]
        second = list(itertools.accumulate(self.second))
        splits, least_total = [], float("inf")
        for k in range(count - 1):
            least_total = min(least_total, first[k] - second[k])  # part 0 = 0..j, part 1 = j+1..k, over j <= k
            low, high = 0, k  # the first j where part 0's sum reaches part 1's
            while low < high:
                middle = (low + high) // 2
                if first[middle] >= second[k] - second[middle]:
                    high = middle
                else:
                    low = middle + 1
            largest = min(max(first[j], second[k] - second[j]) for j in (low - 1, low) if j >= 0)
            splits.append((largest, second[k] + least_total, total - done[k], suffix_max[k + 1]))
        return splits

    def sum_bound(self) -> float:
        if self.cheapest is not None:
            return sum(self.cheapest)
        if self.rest is None or self.num_parts == 1 or len(self.first) < 2:
            return sum(self.first)
        return min(head + tail for _, head, tail, _ in self._splits())

    def max_bound(self) -> float:
        """The largest part is at least the larger of the average part and the largest unit (with the leading
        parts' own coefficients for what they hold)."""
        if self.cheapest is not None:
            return self.constant + max(sum(self.cheapest) / self.num_parts, max(self.cheapest))
        if self.rest is None or self.num_parts == 1 or len(self.first) < 2:
            return self.constant + max(sum(self.first) / self.num_parts, max(self.first))
        others = self.num_parts - (1 if self.second is None else 2)
        return self.constant + min(max(head, tail / others, largest) for head, _, tail, largest in self._splits())


def _families(aggregate: Aggregate, num_parts: int) -> list[_Family]:
    """The families of unit-only terms (one kind, or the same per-unit coefficients) on every part."""
    families: dict[object, dict[int, Term]] = {}
    for part, term in aggregate.members:
        if term.unit_only and term.per_unit:
            families.setdefault(term.family or term.per_unit, {})[part] = term
    found = []
    for members in families.values():
        if len(members) != num_parts:
            continue
        constant = min(t.constant for t in members.values())
        first = members[0].per_unit
        others = [members[part].per_unit for part in range(1, num_parts)]
        if all(per_unit == first for per_unit in others):
            found.append(_Family(constant, num_parts, first))
        elif all(per_unit == others[0] for per_unit in others[1:]):
            found.append(_Family(constant, num_parts, first, others[0]))
        elif (num_parts >= 3 and all(per_unit == others[1] for per_unit in others[2:])
              and min((*first, *others[0])) >= 0):
            found.append(_Family(constant, num_parts, first, others[1], second=others[0]))
        else:
            cheapest = tuple(min(values) for values in zip(first, *others))
            found.append(_Family(constant, num_parts, first, cheapest=cheapest))
    return found


def _max_lower_bound(aggregate: Aggregate, num_parts: int) -> float:
    """Over each family of unit-only terms on every part: its largest part at least (see _Family)."""
    return max((family.max_bound() for family in _families(aggregate, num_parts)), default=0.0)


def memory_floor(costs: CostModel) -> float:
    """A peak no partition goes below, in O(rows x units): at the moment of the forwards and backwards, whose
    rows (one a slot) hold every part, every unit's most frugal coefficient there (over the parts it could be
    on) summed, plus every constant, spread evenly over the slots."""
    rows = costs.compute_memory  # floored here: the others are not needed
    cheapest = np.full(costs.num_units, np.inf)
    constants = 0.0
    for row in rows:
        per_part: dict[int, Any] = {}
        for part, term in ((part, member.floor()) for part, member in row.members):
            constants += term.constant
            held = per_part.get(part, 0.0)
            per_part[part] = held + np.asarray(term.per_unit) if term.per_unit else held
        for held in per_part.values():
            cheapest = np.minimum(cheapest, held)
    return (constants + float(np.maximum(cheapest, 0.0).sum())) / max(1, len(rows))
