"""plan() on the "cpu" device costs a model whose weights are on the CPU from node times measured on this
machine (issue 13): the plan's per-layer times are the profile's at the chosen micro-batch, the same
request plans alike from the cache, and profile= says when not to measure or refuses what it cannot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cost_models.cpu_device import usable_cores
from cost_models.errors import InvalidArgument
from cost_models.profiling import profile
from examples.models.gpt import gpt_tiny
from planner import plan


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    return tmp_path


def _plan(model: torch.nn.Module, **options: object):
    return plan(model, 2, "8GB", batch_size=8, micro_batch_sizes=(2, 4), example_inputs=torch.zeros((1, 32),
                dtype=torch.int64), device="cpu", optimizer="momentum", reserve=0, **options)


def test_a_cpu_plan_is_costed_from_measured_node_times_and_repeats_from_the_cache(cache: Path) -> None:
    torch.manual_seed(0)
    model = gpt_tiny(device="cpu")
    first = _plan(model)
    micro = first.training.micro_batch_size
    measured = profile(model, (torch.zeros((micro, 32), dtype=torch.int64),), "cpu", optimizer="momentum",
                       cache_dir=cache / "profiles",  # the same cached measurement plan() made: beside its
                       co_runners=min(2, usable_cores()) - 1)  # other rank where there is a core for it
    assert measured.source == "measured"
    by_name = {cost.name: cost for cost in measured.costs}
    for row in first.layers:
        assert (row.fwd_ms, row.bwd_ms) == (by_name[row.name].fwd_ms, by_name[row.name].bwd_ms)
    part = first.stages[0]
    assert part.predicted.fwd_ms == pytest.approx(sum(by_name[name].fwd_ms for name in part.nodes))
    def decided(made: object) -> str:  # the plan less the solver's report (its wall time differs)
        data = made.to_dict()  # type: ignore[attr-defined]
        data.pop("solver")
        return json.dumps(data, sort_keys=True)
    assert decided(_plan(model)) == decided(first)
    roofline = _plan(model, profile=False)
    assert [row.fwd_ms for row in roofline.layers] != [row.fwd_ms for row in first.layers]


def test_a_16_bit_cpu_plan_is_timed_in_16_bits_as_the_runtime_computes(cache: Path) -> None:
    """The model is built in fp32; a bf16 plan's node times come from a bf16 copy (the runtime computes in
    bf16; on a CPU without bf16 matmul units that is several times slower than fp32), cached as such."""
    from cost_models.profiling import in_compute_dtype

    model = gpt_tiny(device="cpu")
    assert in_compute_dtype(model, torch.device("cpu"), torch.float32) is model  # no copy where none is needed
    half = in_compute_dtype(model, torch.device("cpu"), torch.bfloat16)
    assert half is not model and {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    made = _plan(model, precision="bf16")
    profiles = sorted(path.name for path in (cache / "profiles").rglob("*.json"))
    assert profiles and all("-bfloat16-" in name for name in profiles), profiles
    tokens = torch.zeros((made.training.micro_batch_size, 32), dtype=torch.int64)
    measured = profile(half, (tokens,), "cpu", optimizer="momentum", precision="bf16", cache_dir=cache / "profiles",
                       co_runners=min(2, usable_cores()) - 1)  # what plan() measured, from its cache
    by_name = {cost.name: cost for cost in measured.costs}
    assert all((row.fwd_ms, row.bwd_ms) == (by_name[row.name].fwd_ms, by_name[row.name].bwd_ms)
               for row in made.layers)


def test_profile_refuses_what_it_cannot_measure(cache: Path) -> None:
    with pytest.raises(InvalidArgument, match="needs the model's weights on the CPU"):
        _plan(gpt_tiny(), profile=True)  # built on meta
    with pytest.raises(InvalidArgument, match="needs the GPU on this machine, but it has no 'V100-16GB'"):
        plan(gpt_tiny(device="cpu"), 2, "8GB", batch_size=8, example_inputs=torch.zeros((1, 32), dtype=torch.int64),
             device="V100-16GB", profile=True)
    meta = _plan(gpt_tiny())  # a model on meta on the cpu device: roofline, as before
    assert meta.stages


def test_planning_more_cpu_ranks_than_cores_warns_in_one_line(cache: Path) -> None:
    """The cpu device is measured one rank per core: a plan for more ranks per node than this machine has
    cores says so (and names the rank count that fits); one within the cores does not, nor one given more GPUs
    than its batch has samples, which uses at most as many ranks as samples (it warned of the GPUs given)."""
    import warnings

    from cost_models.cpu_device import usable_cores
    from cost_models.errors import TesseraWarning

    cores = usable_cores()
    for gpus, batch_size, warns in ((cores + 1, 8, True), (min(cores, 2), 8, False), (cores + 2, min(cores, 2), False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            made = plan(gpt_tiny(), gpus, "8GB", batch_size=batch_size, device="cpu", optimizer="momentum",
                        example_inputs=torch.zeros((1, 32), dtype=torch.int64), reserve=0, profile=False)
        shared = [str(w.message) for w in caught if w.category is TesseraWarning and "cores" in str(w.message)]
        assert len(shared) == warns, shared
        assert made.cluster.gpus <= batch_size
        if warns:
            assert f"{cores + 1} CPU ranks per node on this machine's {cores} cores" in shared[0]
            assert f"plan at most {cores} ranks per node" in shared[0] and "\n" not in shared[0]
    from planner import trace
    from planner.manual import plan_with_split

    tokens = torch.zeros((1, 32), dtype=torch.int64)
    starts = ["blocks_0_ln_2", "blocks_1_ln_1", "blocks_1_ln_2", "ln_f"]  # where a stage may start
    assert set(starts) <= {node.name for node in trace(gpt_tiny(), tokens)}
    if cores > len(starts):
        return  # (a machine with more cores than this model has stages to split)
    with warnings.catch_warnings(record=True) as caught:  # a hand-made split is warned about alike (it was not)
        warnings.simplefilter("always")
        plan_with_split(gpt_tiny(), example_inputs=tokens, batch_size=8, micro_batch_size=1, device="cpu", profile=False,
                        stage_starts=starts[:cores])
    assert [str(w.message) for w in caught if w.category is TesseraWarning and "cores" in str(w.message)]


def test_a_model_planned_with_leaf_modules_is_profiled_with_them(cache: Path) -> None:
    """A module kept whole (a leaf: its forward branches on values, which no tracer captures) is one node of the
    planned graph and of the profiled one (the profile traced without it and found no node 'gate')."""
    class Gate(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x if x.sum() > 0 else -x

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), Gate(), torch.nn.Linear(16, 4))
    made = plan(model, 2, "1GB", batch_size=8, example_inputs=torch.zeros(1, 16), device="cpu", optimizer="sgd",
                reserve=0, leaf_modules=[Gate])
    rows = {row.name: row for row in made.layers}
    assert "_1" in rows and rows["_1"].fwd_ms > 0  # the gate, timed as one node


def test_cpu_ranks_share_the_machines_memory_with_the_host_tier(cache: Path) -> None:
    """On the cpu device the ranks' budgets and the host tier are one memory: a node's host memory is what the
    ranks' budgets leave of it (not the machine's memory once per rank), NVMe is the disk once, and budgets
    that add up to more than the machine has are planned for with one warning line naming the most that fits."""
    import warnings

    from cost_models.devices import get_device
    from cost_models.errors import TesseraWarning
    from planner.api import validate_space

    machine = get_device("cpu")
    quarter = machine.mem_bytes // 4
    space, _ = validate_space(2, quarter, 8, "cpu", None, "momentum", "fp32", None, None, 60.0, reserve=0)
    assert space.host_mem_bytes == machine.host_mem_bytes - 2 * quarter and space.nvme_bytes == machine.nvme_bytes
    given, _ = validate_space(2, quarter, 8, "cpu", None, "momentum", "fp32", None, None, 60.0, host_mem="1GB")
    assert given.host_mem_bytes == 2**30
    for mem, warns in ((3 * quarter, True), (quarter, False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            made = plan(gpt_tiny(), 2, mem, batch_size=8, example_inputs=torch.zeros((1, 32), dtype=torch.int64),
                        device="cpu", optimizer="momentum", reserve=0, profile=False)
        shared = [str(w.message) for w in caught if w.category is TesseraWarning and "share" in str(w.message)]
        assert len(shared) == warns, shared
        if warns:
            assert "more than this machine's" in shared[0] and "give mem, --mem, at most" in shared[0]
            assert "\n" not in shared[0]
        assert made.cluster.host_mem_bytes == max(0, machine.host_mem_bytes - 2 * mem)


def test_a_plan_for_a_gpu_this_machine_has_is_costed_from_times_measured_on_it(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU path's plumbing, with this CPU standing in for the local GPU (tests/gpu runs it on one):
    node times come from the device the model is copied to, memory and transfers from the GPU's spec."""
    import planner.api
    from cost_models.devices import get_device
    from cost_models.graph.tracing import trace
    from cost_models.profiling import in_compute_dtype, measured_table

    stand_in = torch.device("cpu")
    monkeypatch.setattr(planner.api, "local_gpu", lambda device: stand_in if device.name == "H100-80GB" else None)
    torch.manual_seed(0)
    model = gpt_tiny(device="cpu")
    tokens = torch.zeros((1, 32), dtype=torch.int64)
    common = {"batch_size": 8, "micro_batch_sizes": (4,), "example_inputs": tokens, "device": "H100-80GB",
              "optimizer": "momentum", "precision": "fp64", "reserve": 0}
    plan(model, 1, "8GB", **common)  # by default a GPU plan is not measured: nothing is timed (profile=True asks)
    assert not list(cache.rglob("*.json"))
    made = plan(model, 1, "8GB", profile=True, **common)
    copy = in_compute_dtype(model, stand_in, torch.float64)
    table = measured_table(copy, trace(model, (tokens,)), (tokens,), 4, optimizer="momentum", precision="fp64",
                           device=get_device("H100-80GB"))  # from the cache plan() filled
    assert table.source == "measured" and table.device == "H100-80GB"
    by_name = {cost.name: cost for cost in table.costs}
    for row in made.layers:
        assert (row.fwd_ms, row.bwd_ms) == (by_name[row.name].fwd_ms, by_name[row.name].bwd_ms), row.name
    roofline = plan(model, 1, "8GB", profile=False, **common)
    assert sum(row.fwd_ms for row in roofline.layers) < sum(row.fwd_ms for row in made.layers)  # a CPU is slower
    with pytest.raises(InvalidArgument, match="it has no 'A100-40GB'"):
        plan(model, 1, "8GB", batch_size=8, example_inputs=tokens, device="A100-40GB", profile=True)


def test_a_measured_zb_h1_plan_carries_what_splitting_its_backwards_costs(cache: Path) -> None:
    """A CPU plan splitting its backwards (ZB-H1) predicts each later stage's I + W from the profile's split
    timings: the stage's split_extra_ms is its nodes' sum, and its W their weight gradients'. The first
    stage's W is its whole backward (its inputs are data), with nothing extra."""
    from planner.simulation import simulate_plan

    torch.manual_seed(0)
    model = gpt_tiny(device="cpu")
    made = _plan(model, schedules=("zb-h1",), num_stages=(2,), data_parallel=(1,))
    assert made.schedule.kind.value == "zb-h1"
    measured = profile(model, (torch.zeros((made.training.micro_batch_size, 32), dtype=torch.int64),), "cpu",
                       optimizer="momentum", cache_dir=cache / "profiles", co_runners=min(2, usable_cores()) - 1)
    first, second = made.stages
    assert first.predicted.split_extra_ms == 0.0
    assert first.predicted.weight_grad_ms == pytest.approx(first.predicted.bwd_ms)
    assert second.predicted.split_extra_ms == pytest.approx(sum(measured[name].split_extra_ms
                                                                for name in second.nodes))
    assert second.predicted.split_extra_ms != 0.0
    assert second.predicted.weight_grad_ms == pytest.approx(sum(measured[name].weight_grad_ms
                                                                for name in second.nodes))
    # the simulator's busy time counts it: each rank's F + I + W per micro-batch, the extra included
    per_micro = [stage.predicted.fwd_ms + stage.predicted.bwd_ms + stage.predicted.split_extra_ms
                 for stage in made.stages]
    micro = made.training.num_microbatches
    busy = simulate_plan(made).busy_ms
    assert busy == pytest.approx([micro * ms + stage.predicted.optimizer_ms
                                  for ms, stage in zip(per_micro, made.stages)])


def test_a_second_measured_plan_reads_its_profiles_without_capturing_the_model_again(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The profile's cache is keyed by the graph captured at each micro-batch size, so a warm plan still captured
    the model once per size (a Hugging Face model through torch.export: 2 s each, 8 s of a 12 s plan); the
    planned graph's profiles are read by its own fingerprint and size, and give the same plan."""
    from cost_models import profiling

    first = _plan(gpt_tiny(device="cpu"))
    assert sum(row.fwd_ms for row in first.layers) > 0  # measured
    captured = []
    real = profiling.profile_with_graph
    monkeypatch.setattr(profiling, "profile_with_graph", lambda *a, **k: captured.append(1) or real(*a, **k))
    second = _plan(gpt_tiny(device="cpu"))
    assert not captured
    assert second.predicted == first.predicted and second.stages == first.stages
