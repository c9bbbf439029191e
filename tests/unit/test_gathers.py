"""ZeRO-3's gather groups: the planner's grouping and counts (planner/gathers.py) by hand, the runtime's hooks
(runtime/layer_gathers.py) making the collectives the planner counts, and the plan's times and memory with groups
against the same plan gathering layer by layer."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from torch import nn

from cost_models.errors import PlanFileError, RuntimeSetupError
from cost_models.graph.ir import NodeKind
from cost_models.graph.tracing import trace
from planner.gathers import (
    Gathers,
    LayerCall,
    group_cap_bytes,
    group_layers,
    layer_calls,
    regrouped,
    segments,
)
from planner.plan import OffloadSpec, Plan
from planner.search.evaluate import PartSummary
from runtime.layer_gathers import LayerGathers
from runtime.recompute import recompute


def _call(layer: str, nbytes: int, segment: int, recomputed: bool = False) -> LayerCall:
    return LayerCall(layer, (f"{layer}.weight",), nbytes, segment, recomputed)


CALLS = (_call("a", 10, 0), _call("b", 10, 0), _call("c", 30, 0), _call("d", 5, 1, True), _call("e", 5, 1, True),
         _call("f", 10, 2), _call("a", 10, 2))  # (a called again at the end)


def test_layers_group_within_their_run_up_to_the_cap_and_count_the_hooks_collectives() -> None:
    """At a cap of 20 bytes: a and b together, c alone (larger than the cap), d and e (the recomputed run), f. A
    forward opens a's group, c's, d's, f's, and a's again (its second call runs after f's group); a backward
    gathers each group once; the recomputed run's group is gathered once more. At no cap, a group per layer."""
    grouped = group_layers(CALLS, 20)
    assert grouped == Gathers((("a.weight", "b.weight"), ("c.weight",), ("d.weight", "e.weight"), ("f.weight",)),
                              30, forward=5, recompute=1)
    assert grouped.backward == 4
    apart = group_layers(CALLS, 0)
    assert (len(apart.groups), apart.forward, apart.backward, apart.recompute) == (6, 7, 6, 2)


def test_a_group_grows_within_the_memory_left_while_its_gathers_fixed_time_matters() -> None:
    """1 ms fixed and 0.001 ms a byte: a 20,000-byte gather's fixed time is 5% of its bytes' (LATENCY_SHARE), past
    which a group need not grow; the memory left bounds it below that; the largest layer (10 bytes) is the least."""
    assert group_cap_bytes(10, 1000, 1.0, 0.001) == 1000
    assert group_cap_bytes(10, 50_000, 1.0, 0.001) == pytest.approx(20_000)
    assert group_cap_bytes(10, 5, 1.0, 0.001) == 10
    assert group_cap_bytes(10, 50_000, 1.0, 0.0) == 50_000


def test_regrouping_saves_each_collectives_fixed_time_and_holds_the_largest_group() -> None:
    """From the per-layer part: 2 fewer gathers in the forward (7 -> 5), 2 fewer gathers and reduce-scatters in
    the backward (6 -> 4), 1 fewer recomputed gather (2 -> 1); 5 copies of the largest group (30 bytes) in place of
    the model's largest layer (40 bytes, in another part)."""
    part = PartSummary(0, 0, fwd_ms=10.0, bwd_ms=20.0, send_ms=0.0, allreduce_ms=0.0, grad_bytes=0,
                       static_bytes=1000, activation_bytes=0)
    after = regrouped(part, CALLS, group_layers(CALLS, 20), gather_ms=0.5, reduce_ms=0.25, copies_held=(5.0, 5.0),
                      largest_layer_bytes=40)
    assert after.fwd_ms == pytest.approx(10.0 - 2 * 0.5)
    assert after.bwd_ms == pytest.approx(20.0 - 2 * (0.5 + 0.25) - 1 * 0.5)
    assert after.static_bytes == 1000 + 5 * (30 - 40)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.ln1, self.fc2 = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)
        self.ln2, self.fc3 = nn.LayerNorm(8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        h = self.fc2(self.ln1(h))
        return self.fc3(self.ln2(torch.tanh(h)))


REGION = ("ln1", "fc2")


def _net_calls(offload: OffloadSpec) -> tuple[nn.Module, tuple[LayerCall, ...]]:
    torch.manual_seed(0)
    net = _Net().double()
    graph = trace(net, torch.randn(2, 8, dtype=torch.float64))
    names = [node.name for node in graph]
    gathered = frozenset(name for name, _ in net.named_parameters())
    sizes = {name: param.numel() * 8 for name, param in net.named_parameters()}
    return net, layer_calls(graph, names, gathered, sizes, offload)


def test_a_stages_runs_are_its_regions_swapped_runs_and_the_plain_runs_between() -> None:
    torch.manual_seed(0)
    net = _Net().double()
    graph = trace(net, torch.randn(2, 8, dtype=torch.float64))
    names = [node.name for node in graph]
    runs = segments(graph, names, OffloadSpec(zero_stage=3, recompute=(REGION,), swap=("ln2",)))
    assert [runs[name] for name in ("fc1", "relu", "ln1", "fc2", "tanh", "ln2", "fc3")] == [0, 0, 1, 1, 2, 3, 4]


class _Recorder:
    """The part of a ZeRO-3 StageOptimizer the hooks drive: each gather of parameters not held is a collective
    (counted), as are the reductions."""

    zero_stage = 3

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.param_shards = dict.fromkeys(range(len(params)))
        self.holds: dict[int, int] = {}
        self.gathers: list[tuple[int, ...]] = []
        self.reduces: list[tuple[int, ...]] = []
        self.ahead: tuple[int, ...] | None = None
        self.wasted = 0  # gathers started ahead that the next gather did not take

    def gather(self, indices: tuple[int, ...]) -> None:
        if any(not self.holds.get(index) for index in indices):  # (a collective: or the one started ahead)
            ahead, self.ahead = self.ahead, None
            self.wasted += ahead is not None and ahead != tuple(indices)
            if ahead != tuple(indices):
                self.gathers.append(tuple(indices))
        for index in indices:
            self.holds[index] = self.holds.get(index, 0) + 1

    def gather_ahead(self, indices: tuple[int, ...]) -> None:
        if self.ahead is None and any(not self.holds.get(index) for index in indices):
            self.ahead = tuple(indices)
            self.gathers.append(tuple(indices))

    def drop_ahead(self) -> None:
        self.wasted += self.ahead is not None
        self.ahead = None

    def release(self, indices: tuple[int, ...]) -> None:
        for index in indices:
            self.holds[index] -= 1
            assert self.holds[index] >= 0

    def reduce_now(self, indices: list[int]) -> None:
        self.reduces.append(tuple(indices))
        for index in indices:
            self.params[index].grad = None


def _hooked(net: nn.Module, gathers: tuple[tuple[str, ...], ...], ahead: bool = True
            ) -> tuple[torch.fx.GraphModule, _Recorder, LayerGathers]:
    stage = recompute(torch.fx.symbolic_trace(net), [REGION])
    params = dict(net.named_parameters())
    recorder = _Recorder(list(params.values()))
    names = {id(tensor): name for name, tensor in params.items()}
    return stage, recorder, LayerGathers(stage, recorder, (), names, gathers, ahead=ahead,  # type: ignore[arg-type]
                                         stage=0)


def test_the_runtimes_hooks_make_the_collectives_the_plan_counts() -> None:
    """A stage with a checkpoint region (ln1, fc2), its layers grouped by the planner at no cap and at a cap
    holding the whole stage: the forward's all-gathers are the plan's count, the backward's gradient reductions
    one per group, and its gathers (the recomputation's included) at most the plan's count (a region whose last
    group's backward already gathered it recomputes without gathering it again), with and without each gather
    starting the next (those started ahead are counted, and none is wasted); every gather is released."""
    offload = OffloadSpec(zero_stage=3, recompute=(REGION,))
    for cap, ahead in itertools.product((0, 10**9), (False, True)):
        net, calls = _net_calls(offload)
        planned = group_layers(calls, cap)
        stage, recorder, hooks = _hooked(net, planned.groups, ahead)
        out = stage(torch.randn(2, 8, dtype=torch.float64))
        assert len(recorder.gathers) == planned.forward
        forward = len(recorder.gathers)
        hooks.end_pass()
        out.sum().backward()
        hooks.end_pass()
        assert len(recorder.reduces) == planned.backward
        assert planned.backward <= len(recorder.gathers) - forward <= planned.backward + planned.recompute
        assert not any(recorder.holds.values()) and recorder.wasted == 0
        assert (planned.forward, len(planned.groups)) == ((5, 5) if cap == 0 else (3, 3))
        if cap == 0:  # a plan naming no groups (written before they were planned): the same, a group per layer
            net, _calls = _net_calls(offload)
            stage, unnamed, hooks = _hooked(net, (), ahead)
            stage(torch.randn(2, 8, dtype=torch.float64)).sum().backward()
            hooks.end_pass()
            assert (unnamed.gathers, unnamed.reduces) == (recorder.gathers, recorder.reduces)


def test_the_runtime_refuses_groups_that_split_a_layer_span_runs_or_name_strangers() -> None:
    net, _calls = _net_calls(OffloadSpec(zero_stage=3, recompute=(REGION,)))
    whole = tuple(name for name, _ in net.named_parameters())
    split = (("fc1.weight",), ("fc1.bias",), whole[2:])
    with pytest.raises(RuntimeSetupError, match=r"^stage 0's plan gathers the parameters of one layer \(Linear\)"):
        _hooked(net, split)
    with pytest.raises(RuntimeSetupError, match=r"^stage 0's plan gather group 0 spans layers of different"):
        _hooked(net, (whole,))
    with pytest.raises(RuntimeSetupError, match=r"^stage 0's plan gathers parameters \['head.weight'\] by layer"):
        _hooked(net, ((*whole[:2],), ("head.weight",)))


def test_a_plan_gathers_in_groups_as_large_as_its_memory_allows_and_saves_their_collectives_time() -> None:
    """GPT-tiny as one ZeRO-3 stage over 2 replicas on V100-16GB (float64): the planner's groups (memory to spare:
    one group per run of the stage) against the same plan gathering one layer at a time (its groups given): the
    forward loses the fixed time of every all-gather saved (half a two-rank ring all-reduce's: one link latency),
    the backward that of every all-gather and reduce-scatter saved (a whole ring all-reduce's on nccl), and the
    stage holds 4 copies (3 + 2 / 2: planner/search/terms.py gathered_layer_copies) of its whole weights in place
    of its largest layer's."""
    from examples.models.gpt import gpt_tiny
    from planner.manual import plan_with_split

    torch.manual_seed(0)
    model = gpt_tiny(dropout=0.0).double()
    inputs = torch.zeros(1, 32, dtype=torch.long)
    graph = trace(model, inputs)
    arguments = {"example_inputs": inputs, "stage_starts": [], "batch_size": 4, "micro_batch_size": 2,
                 "data_parallel": 2, "schedule": "gpipe", "device": "V100-16GB", "optimizer": "momentum",
                 "precision": "fp64"}
    grouped = plan_with_split(model, offload=[OffloadSpec(zero_stage=3)], **arguments)
    layers = tuple(tuple(dict.fromkeys(node.param_names)) for node in graph
                   if node.kind is NodeKind.MODULE and node.param_names)
    covered = {p for group in grouped.stages[0].offload.gathers for p in group}
    assert covered == {p for layer in layers for p in layer} - {p for node in graph if node.kind is not NodeKind.MODULE
                                                                 for p in node.param_names}
    per_layer = tuple(layer for layer in layers if set(layer) <= covered)
    apart = plan_with_split(model, offload=[OffloadSpec(zero_stage=3, gathers=per_layer)], **arguments)
    assert apart.stages[0].offload.gathers == per_layer and len(grouped.stages[0].offload.gathers) == 1
    latency_ms = grouped.cluster.device["intra_node"]["latency_us"] * 1e-3
    saved = len(per_layer) - 1
    a, b = grouped.stages[0].predicted, apart.stages[0].predicted
    assert a.fwd_ms == pytest.approx(b.fwd_ms - saved * latency_ms)
    assert a.bwd_ms == pytest.approx(b.bwd_ms - saved * 2 * latency_ms)
    sizes = {name: p.numel() * 8 for name, p in model.named_parameters()}
    whole, largest = sum(sizes[p] for p in covered), max(sum(sizes[p] for p in layer) for layer in per_layer)
    assert a.static_bytes - b.static_bytes == round(4 * (whole - largest))
    assert grouped.predicted.step_ms < apart.predicted.step_ms
    assert Plan.from_dict(json.loads(grouped.to_json())).stages[0].offload == grouped.stages[0].offload
    assert "its weights gathered in 1 group, each the next's ahead" in str(grouped)  # (V100s: NCCL prefetches)
    data = json.loads(grouped.to_json())
    data["stages"][0]["offload"]["zero_stage"] = 1
    with pytest.raises(PlanFileError, match=r"offload.prefetch is true but zero_stage is 1"):
        Plan.from_dict(data)
    data["stages"][0]["offload"]["prefetch"] = False
    with pytest.raises(PlanFileError, match=r"offload.gathers lists 1 gather groups but zero_stage is 1"):
        Plan.from_dict(data)
