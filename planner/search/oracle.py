"""Exact dynamic programs over a cost model's terms: the test oracle of the ILP and the memory floor.

Both need every memory row to depend on one part only, which holds when every slot runs one
stage (GPipe, 1F1B); :func:`check_exact` says so otherwise. ``optimal_partition`` keeps, for every
(part, first unit) state, the Pareto set of label vectors: per piece of the objective the partition
changes, its running sum or maximum, and for a drain its suffix flow, suffix pace and best value so
far. The step is increasing in each, so the optimum is kept exactly. ``min_peak_partition``
minimises the largest memory row; ``decided_step_floor`` bounds the step with memory decisions from
below (the time a part must pay to free what it holds beyond the budget).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from planner.search.evaluate import Evaluation, evaluate, term_value, weighted_matrix
from planner.search.ilp import Window
from planner.search.terms import Aggregate, CostModel, Drain, MemoryRow, Reduce, Term, fixed_sum

_Label = tuple[tuple[float, ...], tuple[int, ...]]  # (piece values so far, cuts so far)


@dataclass(frozen=True)
class OracleResult:
    cuts: tuple[int, ...]
    evaluation: Evaluation
    peak_bytes: int = 0  # min_peak_partition: the smallest largest row (of the rows it minimised)


def check_exact(costs: CostModel, *, decisions_allowed: bool = False) -> None:
    """Raise ValueError unless every memory row depends on a single part (what the DPs need) and,
    unless ``decisions_allowed``, the model has no memory decisions (the DPs place cuts only)."""
    shared = [row.slot for row in costs.memory if len({part for part, _ in row.members}) != 1]
    if shared:
        raise ValueError(f"slots {shared} hold several parts; the exact dynamic programs handle layouts "
                         f"with one stage per slot only")
    if costs.decides and not decisions_allowed:
        raise ValueError("the model decides recompute, swap and state tiers; the dynamic programs place "
                         "cuts only (the ILP decides)")


def optimal_partition(costs: CostModel) -> OracleResult | None:
    """The minimum-step-time feasible partition, or None if no partition fits the memory.

    Parts are placed from the last to the first (a drain sums and maximises over suffixes); the
    state is the first unit of the parts placed so far, the label each varying piece's running value.
    """
    check_exact(costs)
    pieces = [piece for piece in costs.objective if isinstance(piece, Drain)
              or (piece.members and fixed_sum(piece, costs.num_parts) is None)]
    fixed = sum(piece.weight * (fixed_sum(piece, costs.num_parts) or 0.0) for piece in costs.objective
                if isinstance(piece, Aggregate))
    start: tuple[float, ...] = tuple(v for piece in pieces for v in _initial(piece))
    frontier: dict[int, list[_Label]] = {costs.num_units: [(start, ())]}
    for part in reversed(range(costs.num_parts)):
        members = [_members_of(piece, part) for piece in pieces]
        rows = [[term for _, term in row.members] for row in costs.memory if row.members[0][0] == part]
        following: dict[int, list[_Label]] = {}
        for next_first, labels in frontier.items():
            for first in range(part, next_first):  # the parts before this one need a unit each
                contribution = _part_contribution(costs, members, rows, first, next_first - 1)
                if contribution is None:
                    continue
                cut = (first - 1,) if part else ()
                for values, cuts in labels:
                    following.setdefault(first, []).append((_fold(pieces, values, contribution), cut + cuts))
        frontier = {first: _pareto(labels) for first, labels in following.items()}
    labels = frontier.get(0, [])
    if not labels:
        return None
    best = min(labels, key=lambda label: fixed + _objective(pieces, label[0]))
    return OracleResult(best[1], evaluate(costs, best[1]))


_Members = tuple[list[Term], ...]  # an aggregate's terms on one part, or a drain's (flow, pace, tail) terms


def _members_of(piece: Aggregate | Drain, part: int) -> _Members:
    groups = (piece.flow, piece.pace, piece.tail) if isinstance(piece, Drain) else (piece.members,)
    return tuple([term for member, term in group if member == part] for group in groups)


def _initial(piece: Aggregate | Drain) -> tuple[float, ...]:
    return (0.0, 0.0, float("-inf")) if isinstance(piece, Drain) else (0.0,)


def _part_contribution(costs: CostModel, members: list[_Members], rows: list[list[Term]], first: int,
                       last: int) -> list[tuple[float, ...]] | None:
    """Per piece, its terms' values on a part holding units first..last (sums; the pace a maximum);
    None if one of the part's memory ``rows`` does not fit."""
    for terms in rows:
        if sum(term_value(costs, term, first, last) for term in terms) > costs.problem.mem_bytes:
            return None
    contribution = []
    for groups in members:
        values = [[term_value(costs, term, first, last) for term in group] for group in groups]
        if len(groups) == 3:  # a drain: flow, pace, tail
            contribution.append((sum(values[0]), max(values[1], default=0.0), sum(values[2])))
        else:
            contribution.append((sum(values[0]), max(values[0], default=0.0)))
    return contribution


def _fold(pieces: list[Aggregate | Drain], values: tuple[float, ...],
          contribution: list[tuple[float, ...]]) -> tuple[float, ...]:
    """The label after adding one part (placed before the parts already in ``values``)."""
    merged: list[float] = []
    offset = 0
    for piece, part in zip(pieces, contribution):
        if isinstance(piece, Drain):
            flow, pace, best = values[offset:offset + 3]
            flow, pace = flow + part[0], max(pace, part[1])
            merged += [flow, pace, max(best, flow + piece.pace_weight * pace + part[2])]
            offset += 3
        else:
            total = values[offset] + part[0] if piece.reduce is Reduce.SUM else max(values[offset], part[1])
            merged.append(total)
            offset += 1
    return tuple(merged)


def _objective(pieces: list[Aggregate | Drain], values: tuple[float, ...]) -> float:
    total, offset = 0.0, 0
    for piece in pieces:
        width = 3 if isinstance(piece, Drain) else 1
        total += piece.weight * values[offset + width - 1]
        offset += width
    return total


def _pareto(labels: list[_Label]) -> list[_Label]:
    kept: list[_Label] = []
    for label in sorted(labels, key=lambda lab: lab[0]):
        if not any(all(k <= v for k, v in zip(other[0], label[0])) for other in kept):
            kept.append(label)
    return kept


def min_peak_partition(costs: CostModel) -> OracleResult:
    """The partition whose largest memory row is smallest (the budget ignored).

    A min-max DP over (part, last unit); each part's memory for every (first, last) unit is one
    numpy matrix, so a 16-part, 150-unit problem takes milliseconds. With memory decisions, the rows
    minimised have every decision at its most frugal (``costs.frugal_memory``): ``peak_bytes`` is
    then a lower bound of what any decisions need (without them, the exact peak).
    """
    check_exact(costs, decisions_allowed=True)
    rows = costs.frugal_memory
    num_units = costs.num_units
    bests, choices = _chain(lambda part: _peak_matrix(costs, rows, part), np.maximum, num_units,
                            costs.num_parts)
    best = bests[-1]
    cuts: list[int] = []
    last = num_units - 1
    for choice in reversed(choices):
        first = int(choice[last])
        cuts.append(first - 1)
        last = first - 1
    cuts.reverse()
    return OracleResult(tuple(cuts), evaluate(costs, tuple(cuts)), round(float(best[num_units - 1])))


def _chain(part_matrix: Callable[[int], np.ndarray], combine: Callable[[np.ndarray, np.ndarray], np.ndarray],
           num_units: int, num_parts: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The least ``combine`` over parts 0..s of ``part_matrix(part)[first, last]``, over every partition
    into contiguous non-empty parts: per part s, per last unit of part s (inf where the parts after it
    would have too few units); and per part s > 0 the first unit each last unit's best choice starts at."""
    units = np.arange(num_units)
    bests = [np.where(units <= num_units - num_parts, part_matrix(0)[0], np.inf)]
    choices: list[np.ndarray] = []
    backwards = units[:, None] > units[None, :]
    for part in range(1, num_parts):
        remaining = num_parts - part - 1
        before = np.concatenate(([np.inf], bests[-1][:-1]))  # before[first]: the best up to unit first - 1
        value = combine(before[:, None], part_matrix(part))
        value[backwards | (units[:, None] < part)] = np.inf  # first <= last, first >= part
        choice = np.argmin(value, axis=0)  # the lowest first among equals
        bests.append(np.where((units >= part) & (units < num_units - remaining), value[choice, units], np.inf))
        choices.append(choice)
    return bests, choices


def _peak_matrix(costs: CostModel, rows: tuple[MemoryRow, ...], part: int) -> np.ndarray:
    """The largest memory row of ``part`` holding units first..last, at [first, last]."""
    peaks = np.zeros((costs.num_units, costs.num_units))
    for row in rows:
        if row.members[0][0] == part:
            peaks = np.maximum(peaks, weighted_matrix(costs, [(term, 1.0) for _, term in row.members]))
    return peaks


def decided_step_floor(costs: CostModel, enough_ms: float = float("inf"),
                       window: Window | None = None) -> float:
    """A step time no partition beats, whatever its recompute and swap shares (inf: none fits); once
    a bound reaches ``enough_ms`` (what its caller needs, to skip the configuration) it is returned at once.
    With a ``window`` (per cut, the range of units its part may end at, as the ILP takes it), only the
    partitions within it count.

    The step is at least, for any part k, the sum of the objective's sums, the drain from part 0
    (its flow, part 0's tail) and each maximum's (and the drain pace's) first member on part k: a
    sum over parts, minimised over partitions by min-plus DPs (from the first part and from the last,
    joined at part k). A part holding units first..last pays, besides those terms without
    decisions, the time to free what its memory rows hold beyond the budget, where a region's kept
    inputs count as free (inf where even every unit at its most frugal does not fit): for each row at
    least its excess times the fewest ms per byte freed of any unit it holds (recompute or swap), and at
    least a fractional knapsack's least time over a superset of its units (_least_freeing_ms); the most
    of its rows' (the same decisions free bytes in every row, so their times do not add up). Needs
    check_exact's layouts (one part per memory row); -inf where a decision could cost negative time
    or memory. tests/unit/test_memory_tiers.py checks it against a brute force and the ILP.
    """
    check_exact(costs, decisions_allowed=True)
    num_units, num_parts = costs.num_units, costs.num_parts
    rows = [_freeable(costs, part) for part in range(num_parts)]
    base = [_windowed(_part_floor(costs, _floor_terms(costs, part, paced=False), part, rows[part]), part, window)
            for part in range(num_parts)]
    if any(matrix is None for matrix in base):
        return float("-inf")
    heads, _ = _chain(lambda part: base[part], np.add, num_units, num_parts)
    best = float(heads[-1][-1])  # the sums alone, no maximum counted
    if best >= enough_ms:
        return best
    paces = [_pace_matrix(costs, part) for part in range(num_parts)]
    if all(pace is not None for pace in paces):
        best = max(best, _bottleneck_floor(base, paces, best, enough_ms))  # type: ignore[arg-type]
        if best >= enough_ms:
            return best
    tails, _ = _chain(lambda part: base[num_parts - 1 - part][::-1, ::-1].T, np.add, num_units, num_parts)
    units = np.arange(num_units)
    for paced in sorted(range(num_parts), key=lambda part: -float(base[part].min())):  # likely binding first
        own = _windowed(_part_floor(costs, _floor_terms(costs, paced, paced=True), paced, rows[paced]), paced,
                        window)
        if own is None:
            return float("-inf")
        before = (np.where(units == 0, 0.0, np.inf) if paced == 0
                  else np.concatenate(([np.inf], heads[paced - 1][:-1])))  # parts 0..paced-1 up to first - 1
        after = (np.where(units == num_units - 1, 0.0, np.inf) if paced == num_parts - 1
                 else np.append(tails[num_parts - 2 - paced][::-1][1:], np.inf))  # parts paced+1.. from last + 1
        total = before[:, None] + own + after[None, :]
        total[units[:, None] > units[None, :]] = np.inf
        best = max(best, float(total.min()))
        if best >= enough_ms:
            break
    return best


BOTTLENECK_DPS = 12
"""At most this many dynamic programs bound the step of one configuration by its bottleneck
(:func:`_bottleneck_floor`), each one chain over the parts (a millisecond or two for 16 parts of 150 units):
where the bound proves a configuration cannot win it took one or two on the zoo, and where it could not it
used up any larger allowance (48 took a second of ResNet-1001's search on 16 V100s)."""


def _bottleneck_floor(base: list[np.ndarray], paces: list[np.ndarray], sums_ms: float, enough_ms: float) -> float:
    """A step no partition beats: its parts' ``base`` (the sums' floor, inf where a part does not fit) summed,
    plus its bottleneck, the most any part's ``paces`` (the maxima's first members, weighted) is. The maxima
    of the step are each at least their member on any one part, so together at least the bottleneck.

    Let S(T) be the least sum over the partitions whose every part's pace is at most T (a min-plus dynamic
    program with the other entries masked; ``sums_ms`` = S(inf)). S only falls as T rises, so a partition
    whose bottleneck lies in (a, b] takes at least S(b) + a, and one whose bottleneck is above a at least
    S(inf) + a. Starting at the least bottleneck of any partition that fits (a min-max program), each
    interval is taken as wide as still proves the least of ``enough_ms`` and the bound so far (bisection),
    until S(inf) + a reaches it; the least over the intervals is returned. Where memory forces uneven parts
    (ResNet-1001 at 1024x1024 on 13 stages: 1,874 ms bounded by the sums and each part's pace alone), the
    first interval alone bounds it within 1% of its optimum (5,439 ms against 5,452 ms).
    """
    num_units, num_parts = base[0].shape[0], len(base)
    least, _ = _chain(lambda part: np.where(np.isfinite(base[part]), paces[part], np.inf), np.maximum,
                      num_units, num_parts)
    low = float(least[-1][-1])  # every partition that fits has a bottleneck of at least this
    if not np.isfinite(low) or not np.isfinite(sums_ms):
        return float("inf")
    programs = 1

    def least_sum(limit: float) -> float:  # S(limit)
        nonlocal programs
        programs += 1
        heads, _ = _chain(lambda part: np.where(paces[part] <= limit, base[part], np.inf), np.add,
                          num_units, num_parts)
        return float(heads[-1][-1])

    bound = float("inf")
    while programs < BOTTLENECK_DPS and low + sums_ms < min(bound, enough_ms):
        need = min(bound, enough_ms)
        if need == float("inf"):  # no target yet: the partitions whose bottleneck is the least possible
            bound = least_sum(low) + low
            continue
        high = need - sums_ms  # above it, S(inf) + low reaches need already
        if least_sum(high) + low >= need:
            low = high
            continue
        proven, trying = low, high  # the widest interval (low, b] with S(b) + low >= need
        for _ in range(8):
            middle = (proven + trying) / 2
            if least_sum(middle) + low >= need:
                proven = middle
            else:
                trying = middle
        if proven == low:  # not even a sliver proves it: the bound falls to what the sliver gives
            bound = least_sum(trying) + low
            proven = trying
        low = proven
    return min(bound, low + sums_ms)


def _pace_matrix(costs: CostModel, part: int) -> np.ndarray | None:
    """At [first, last]: the maxima's first members on ``part`` weighted as in :func:`_floor_terms` (paced),
    with every decision at none; None where a decision could lower one (then none is a floor)."""
    paced = [(term, weight) for term, weight in _floor_terms(costs, part, paced=True)]
    for term, weight in _floor_terms(costs, part, paced=False):
        paced.remove((term, weight))
    if any(min((*term.per_recompute, *term.per_swap, *term.per_start), default=0.0) < 0 or weight < 0
           for term, weight in paced):
        return None
    return weighted_matrix(costs, paced) if paced else np.zeros((costs.num_units, costs.num_units))


def window_memory_floor(costs: CostModel, window: Window) -> float:
    """A peak no partition within ``window`` goes below, whatever its recompute and swap shares, for layouts
    whose slots hold several parts too (interleaved 1F1B, GEMS-MASTER): the most of any memory row, each of
    its parts at its least within the window (a part's first unit follows the cut before it, its last is its
    own cut) with every decision at its most frugal. Above the budget, the window's ILP has no solution: a
    50B GPT's interleaved configurations on 16 V100-32GB were solved for 0.2-1.0 s each to learn that their
    even cuts leave the language-model head's part beyond any budget."""
    blocks = _window_blocks(costs, window)
    least: dict[tuple[int, tuple[int, ...]], float] = {}  # by part and member terms: parts share their terms
    peak = 0.0
    for row in costs.frugal_memory:
        members: dict[int, list[Term]] = {}
        for part, term in row.members:
            members.setdefault(part, []).append(term)
        held = 0.0
        for part, terms in members.items():
            key = (part, tuple(id(term) for term in terms))
            if key not in least:
                firsts, lasts, ordered = blocks[part]
                values = weighted_matrix(costs, [(term, 1.0) for term in terms], firsts, lasts)[ordered]
                least[key] = float(values.min()) if values.size else float("inf")
            held += least[key]
        peak = max(peak, held)
    return peak


_Block = tuple[range, range, np.ndarray]  # a part's first units, its last units, and which (first, last) are parts


def _window_blocks(costs: CostModel, window: Window) -> list[_Block]:
    """Per part, the units it may start at (one after the cut before it), those it may end at (its own cut), and
    which pairs of them make a part (first <= last) within ``window``."""
    num_units, num_parts = costs.num_units, costs.num_parts
    blocks = []
    for part in range(num_parts):
        firsts = range(1) if part == 0 else range(window[part - 1][0] + 1, window[part - 1][1] + 2)
        lasts = range(num_units - 1, num_units) if part == num_parts - 1 else range(window[part][0],
                                                                                    window[part][1] + 1)
        blocks.append((firsts, lasts, np.asarray(firsts)[:, None] <= np.asarray(lasts)[None, :]))
    return blocks


def _least_over_window(blocks: list[_Block], values: list[np.ndarray]) -> float:
    """The least sum over the parts of ``values`` (per part, at [i, j] its value holding units ``firsts[i]`` to
    ``lasts[j]`` of its block) over the partitions within the window: a min-plus chain, part s's firsts being
    part s - 1's lasts plus one."""
    least = np.where(blocks[0][2][0], values[0][0], np.inf)  # per last unit of part 0
    for (_, _, ordered), value in zip(blocks[1:], values[1:]):
        least = np.min(least[:, None] + np.where(ordered, value, np.inf), axis=0)
    return float(least.min())


SHARED_SLOT_MIXES = (1.0, 0.75, 0.5)
"""The weights :func:`shared_slot_step_floor` tries on a maximum's largest family of members (the rest on its
second): with swap allowed, a bottleneck's swap members are the only ones a swap costs time in."""


def shared_slot_step_floor(costs: CostModel, window: Window, enough_ms: float = float("inf")) -> float:
    """A step time no partition within ``window`` beats, whatever its recompute and swap shares, for layouts
    whose slots hold several parts too (interleaved 1F1B, GEMS-MASTER), where :func:`decided_step_floor`'s
    per-part rows do not apply; returned once a bound reaches ``enough_ms``.

    The step is at least a sum over the parts (:func:`_averaged_terms`: the objective's sums, and each maximum
    at least its families' average over the parts), so at least that sum without decisions plus what the
    decisions add, sum_u a_u x_u (unit u's recompute or swap share x_u, a_u its weighted time). A slot fits only
    if those decisions free what a row of it holds beyond the budget: sum_u f_u x_u >= held - budget (f_u the
    bytes unit u frees in it). With rho at most every a_u / f_u (f_u summed over the rows of one moment, one a
    slot), the decisions cost at least rho (held - budget) summed over those rows (a Lagrangian relaxation),
    which is a sum over parts again: a min-plus chain over the window's partitions (:func:`_least_over_window`)
    minimises it, for rho, rho / 2 and 0, the rows at the forwards' and backwards' peak and at a recomputed
    region's backward (which holds its block again), and a few mixes of a maximum's families. -inf where a
    decision could lower a time or a row. On ResNet-1001 at 1024x1024 on 16 A100s it proves 35 of 41
    interleaved configurations slower than the search's cutoff, each a 0.1-0.5 s ILP before.
    """
    num_parts = costs.num_parts
    if any(min(term.per_start, default=0.0) < 0 for row in costs.memory for _, term in row.members):
        return float("-inf")  # a region start could lower a row
    blocks = _window_blocks(costs, window)
    moments: dict[str, tuple[int, list] | None] = {}  # per moment, when first needed: its rows' count (one a
    # slot), and per part what they hold and free (None: no such rows)

    def rows_at(moment: str) -> tuple[int, list] | None:
        if moment not in moments:
            rows = [row for row in costs.memory if row.moment == moment]
            moments[moment] = (len(rows), [_held_and_freed(costs, rows, part, blocks[part])
                                           for part in range(num_parts)]) if rows else None
        return moments[moment]

    best = float("-inf")
    for mix in SHARED_SLOT_MIXES:
        chosen, mixed = _averaged_terms(costs, mix)
        if any(weight < 0 or min((*term.per_start, *term.per_recompute, *term.per_swap), default=0.0) < 0
               for terms in chosen for term, weight in terms):
            return float("-inf")  # a decision could lower the step
        base = [weighted_matrix(costs, terms, firsts, lasts) for terms, (firsts, lasts, _) in zip(chosen, blocks)]
        for share, moment in ((1.0, "recompute"), (1.0, "compute"), (0.5, "recompute"), (0.5, "compute"), (0.0, "")):
            found = rows_at(moment) if share else None
            rho = share * _cheapest_freeing(costs, chosen, [freed for _, freed in found[1]]) if found else 0.0
            if share and not 0 < rho < float("inf"):
                continue  # (no such rows, or nothing frees bytes there, or something frees them for no time)
            matrices = [matrix + rho * held for matrix, (held, _) in zip(base, found[1])] if rho else base
            best = max(best, _least_over_window(blocks, matrices)
                       - (rho * found[0] * costs.problem.mem_bytes if rho else 0.0))
            if best >= enough_ms:
                return best
        if not mixed:
            break
    return best


def _averaged_terms(costs: CostModel, mix: float) -> tuple[list[list[tuple[Term, float]]], bool]:
    """Per part, (term, weight) pairs whose sum over the parts is at most the step, whatever the partition and the
    decisions: every sum's members; a drain's flow and part 0's tail (its drain from part 0) and its pace as a
    maximum; a maximum as the average over the parts of its largest family with a member on every part, or
    where it has two such, ``mix`` times that plus the rest times its second's (each family's average is at
    most the maximum). Also whether any maximum had two."""
    chosen: list[list[tuple[Term, float]]] = [[] for _ in range(costs.num_parts)]
    mixed = False

    def averaged(members: tuple[tuple[int, Term], ...], weight: float) -> None:
        nonlocal mixed
        families: dict[str, list[tuple[int, Term]]] = {}
        for part, term in members:
            families.setdefault(term.family, []).append((part, term))
        full = sorted((family for family in families.values()
                       if sorted(part for part, _ in family) == list(range(costs.num_parts))),
                      key=lambda family: -sum(term.constant + sum(term.per_unit) for _, term in family))
        mixed = mixed or len(full) > 1
        for family, share in zip(full, (mix, 1.0 - mix) if len(full) > 1 else (1.0,)):
            for part, term in family:
                chosen[part].append((term, weight * share / costs.num_parts))

    for piece in costs.objective:
        if isinstance(piece, Drain):
            for part, term in piece.flow + tuple(member for member in piece.tail if member[0] == 0):
                chosen[part].append((term, piece.weight))
            averaged(piece.pace, piece.weight * piece.pace_weight)
        elif piece.reduce is Reduce.SUM:
            for part, term in piece.members:
                chosen[part].append((term, piece.weight))
        else:
            averaged(piece.members, piece.weight)
    return chosen, mixed


def _held_and_freed(costs: CostModel, rows: list[MemoryRow], part: int, block: _Block
                    ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """What ``part``'s members of ``rows`` hold together without decisions over its ``block`` (at [i, j] from
    its i-th first unit to its j-th last), and per unit the bytes recomputing it frees there and those swapping
    it frees."""
    terms = [term for row in rows for member, term in row.members if member == part]

    def frees(name: str) -> np.ndarray:
        return -sum((_coefficients(getattr(term, name), costs.num_units) for term in terms), np.zeros(costs.num_units))

    held = weighted_matrix(costs, [(term, 1.0) for term in terms], block[0], block[1])
    return held, (frees("per_recompute"), frees("per_swap"))


def _cheapest_freeing(costs: CostModel, chosen: list[list[tuple[Term, float]]],
                      freed: list[tuple[np.ndarray, np.ndarray]]) -> float:
    """The fewest weighted ms per byte freed of any unit's recompute or swap on any part (0 where one frees
    bytes for no time; inf where none frees any): ``freed`` per part, per unit the bytes recomputing and
    swapping it free."""
    cheapest = float("inf")
    for part, terms in enumerate(chosen):
        for name, frees in zip(("per_recompute", "per_swap"), freed[part]):
            costs_ms = sum((weight * _coefficients(getattr(term, name), costs.num_units) for term, weight in terms),
                           np.zeros(costs.num_units))
            if (frees > 0).any():
                cheapest = min(cheapest, float(np.min(costs_ms[frees > 0] / frees[frees > 0])))
    return cheapest


def _windowed(matrix: np.ndarray | None, part: int, window: Window | None) -> np.ndarray | None:
    """``matrix`` (part ``part`` holding units first..last at [first, last]) with inf wherever the part
    would start or end outside ``window``."""
    if matrix is None or window is None:
        return matrix
    units = np.arange(matrix.shape[0])
    outside = np.zeros(matrix.shape, dtype=bool)
    if part < len(window):  # its last unit is cut ``part``
        low, high = window[part]
        outside |= ((units < low) | (units > high))[None, :]
    if part > 0:  # its first unit follows cut ``part - 1``
        low, high = window[part - 1]
        outside |= ((units - 1 < low) | (units - 1 > high))[:, None]
    return np.where(outside, np.inf, matrix)


def _floor_terms(costs: CostModel, part: int, paced: bool) -> list[tuple[Term, float]]:
    """``part``'s (term, weight) pairs of decided_step_floor's sum (its maxima's first members if ``paced``)."""
    chosen: list[tuple[Term, float]] = []
    for piece in costs.objective:
        if isinstance(piece, Drain):
            chosen += [(term, piece.weight) for member, term in piece.flow if member == part]
            chosen += [(term, piece.weight) for member, term in piece.tail if member == part == 0]
            pace = [term for member, term in piece.pace if member == part]
            if paced and pace and piece.pace_weight:
                chosen.append((pace[0], piece.weight * piece.pace_weight))
        elif piece.reduce is Reduce.SUM:
            chosen += [(term, piece.weight) for member, term in piece.members if member == part]
        elif paced:
            chosen += [(term, piece.weight) for member, term in piece.members if member == part][:1]
    return chosen


_Freeable = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # held, fits at its most frugal, freed per unit


def _freeable(costs: CostModel, part: int) -> list[_Freeable] | None:
    """Per memory row of ``part``: what it holds without decisions at [first, last], whether it fits with
    every unit at its most frugal, and the bytes recomputing and swapping each unit frees (None where a
    region start would free memory)."""
    count = costs.num_units
    firsts, lasts = np.arange(count)[:, None], np.arange(count)[None, :]
    found = []
    for row in costs.memory:
        if row.members[0][0] != part:
            continue
        terms = [term for _, term in row.members]
        if any(min(term.per_start, default=0.0) < 0 for term in terms):
            return None
        held = weighted_matrix(costs, [(term, 1.0) for term in terms])
        by_recompute = -sum(_coefficients(term.per_recompute, count) for term in terms)
        by_swap = -sum(_coefficients(term.per_swap, count) for term in terms)
        most = np.concatenate(([0.0], np.cumsum(np.maximum(0.0, np.maximum(by_recompute, by_swap)))))
        fits = held - (most[lasts + 1] - most[firsts]) <= costs.problem.mem_bytes
        found.append((held, fits, by_recompute, by_swap))
    return found


def _part_floor(costs: CostModel, chosen: list[tuple[Term, float]], part: int,
                rows: list[_Freeable] | None) -> np.ndarray | None:
    """At [first, last]: the weighted terms without decisions plus the least time to free the memory
    beyond the budget (see decided_step_floor; None where a decision could lower a time or a row)."""
    count = costs.num_units
    recompute_ms = sum((weight * _coefficients(term.per_recompute, count) for term, weight in chosen), np.zeros(count))
    swap_ms = sum((weight * _coefficients(term.per_swap, count) for term, weight in chosen), np.zeros(count))
    if rows is None or any(weight < 0 or min(term.per_start, default=0.0) < 0 for term, weight in chosen) or min(
            recompute_ms.min(), swap_ms.min()) < 0:
        return None
    value = weighted_matrix(costs, chosen)
    firsts, lasts = np.arange(count)[:, None], np.arange(count)[None, :]
    freeing_ms = np.zeros_like(value)  # the most any one row needs: the same decisions free every row's bytes
    for held, fits, by_recompute, by_swap in rows:
        with np.errstate(divide="ignore", invalid="ignore"):
            per_byte = np.minimum(np.where(by_recompute > 0, recompute_ms / by_recompute, np.inf),
                                  np.where(by_swap > 0, swap_ms / by_swap, np.inf))
            cheapest = np.minimum.accumulate(np.where(lasts >= firsts, per_byte[None, :], np.inf), axis=1)
            excess = held - costs.problem.mem_bytes
            freeing = np.maximum(excess * cheapest, _least_freeing_ms(
                (recompute_ms, swap_ms, by_recompute, by_swap), excess, part == 0, part == costs.num_parts - 1))
            freeing_ms = np.maximum(freeing_ms, np.where(excess > 0, freeing, 0.0))
        value = np.where(fits, value, np.inf)
    return value + freeing_ms


def _least_freeing_ms(freeing: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], excess: np.ndarray,
                      first_part: bool, last_part: bool) -> np.ndarray:
    """At [first, last]: the least time to free ``excess`` bytes with shares of units (a fractional
    knapsack, the fewest ms per byte first; a unit's recompute and swap are two items): over every unit,
    and for the first part (whose units are 0..last) over those, for the last part (first..U-1) over those.
    ``freeing``: per unit, the ms and bytes of recomputing it, and of swapping it."""
    recompute_ms, swap_ms, by_recompute, by_swap = freeing
    count = len(recompute_ms)
    freed, ms = np.concatenate((by_recompute, by_swap)), np.concatenate((recompute_ms, swap_ms))
    owner = np.concatenate((np.arange(count), np.arange(count)))
    useful = freed > 0
    order = np.argsort(ms[useful] / freed[useful], kind="stable")
    freed, ms, owner = freed[useful][order], ms[useful][order], owner[useful][order]

    def curves(held: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # per row: cumulative bytes and ms
        start = np.zeros((held.shape[0], 1))
        return (np.concatenate((start, np.cumsum(np.where(held, freed, 0.0), axis=1)), axis=1),
                np.concatenate((start, np.cumsum(np.where(held, ms, 0.0), axis=1)), axis=1))

    every_freed, every_ms = curves(np.ones((1, len(freed)), dtype=bool))
    least = np.interp(excess, every_freed[0], every_ms[0])
    units = np.arange(count)[:, None]
    if first_part:
        total_freed, total_ms = curves(owner[None, :] <= units)
        least[0] = _row_interp(excess[0], total_freed, total_ms)  # row: last
    if last_part:
        total_freed, total_ms = curves(owner[None, :] >= units)
        least[:, -1] = _row_interp(excess[:, -1], total_freed, total_ms)  # row: first
    return least


def _row_interp(x: np.ndarray, xp: np.ndarray, fp: np.ndarray) -> np.ndarray:
    """``np.interp(x[r], xp[r], fp[r])`` for every row r at once (each ``xp[r]`` non-decreasing, its
    repeated points repeating their ``fp``)."""
    rows = np.arange(len(x))
    above = (xp < x[:, None]).sum(axis=1)  # the first point at or past x
    at = np.minimum(above, xp.shape[1] - 1)
    before = np.maximum(above - 1, 0)
    x0, x1, y0, y1 = xp[rows, before], xp[rows, at], fp[rows, before], fp[rows, at]
    with np.errstate(divide="ignore", invalid="ignore"):
        between = y0 + (x - x0) * (y1 - y0) / (x1 - x0)
    return np.where(above == 0, fp[:, 0], np.where(above == xp.shape[1], fp[:, -1], between))


def _coefficients(values: tuple[float, ...], count: int) -> np.ndarray:
    return np.asarray(values, dtype=float) if values else np.zeros(count)
