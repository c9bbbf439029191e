"""runtime.seeding.ForwardSeeds: each forward's dropout masks, equal wherever the forward runs, and the
caller's generator left as it was."""

from __future__ import annotations

import itertools

import torch

from runtime.seeding import ForwardSeeds, derive_seed, mix_seed


def _mask(seeds: ForwardSeeds, step: int, stage: int, microbatch: int) -> torch.Tensor:
    seeds.apply(step, stage, microbatch)
    return torch.nn.functional.dropout(torch.ones(256), p=0.5)


def test_a_forward_draws_the_same_masks_in_every_process_and_different_ones_elsewhere() -> None:
    here, there = ForwardSeeds(3, torch.device("cpu")), ForwardSeeds(3, torch.device("cpu"))  # two ranks
    with here.step(), there.step():
        assert torch.equal(_mask(here, 5, 1, 2), _mask(there, 5, 1, 2))
        assert torch.equal(_mask(here, 5, 1, 2), _mask(here, 5, 1, 2))  # a recompute, later in the step
        masks = [_mask(here, *key) for key in ((5, 1, 2), (6, 1, 2), (5, 0, 2), (5, 1, 3))]
    assert all(not torch.equal(masks[0], other) for other in masks[1:])
    assert not torch.equal(_mask(ForwardSeeds(4, torch.device("cpu")), 5, 1, 2), masks[0])  # another --seed
    # the step's seed: the (stage, micro-batch) part from sha256, the step mixed in by splitmix64
    assert here.value(5, 1, 2) == mix_seed(derive_seed(3, "forward", 1, 2), 5) < 2**63


def test_the_callers_generator_continues_after_the_step_as_if_it_had_not_run() -> None:
    torch.manual_seed(11)
    expected = (torch.rand(1), torch.rand(4))
    torch.manual_seed(11)
    first = torch.rand(1)
    seeds = ForwardSeeds(0, torch.device("cpu"))
    with seeds.step():
        _mask(seeds, 0, 0, 0)
        _mask(seeds, 0, 1, 1)
    assert torch.equal(first, expected[0]) and torch.equal(torch.rand(4), expected[1])


def test_mixing_the_step_spreads_neighbouring_steps_apart() -> None:
    seeds = [mix_seed(12345, step) for step in range(1000)]
    assert len(set(seeds)) == 1000 and all(0 <= seed < 2**63 for seed in seeds)
    bits = [(a ^ b).bit_count() for a, b in itertools.pairwise(seeds)]
    assert 25 < sum(bits) / len(bits) < 38  # about half of the 63 bits flip from one step to the next
