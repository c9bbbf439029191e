"""cost_models.profile: measured node times sum to the whole model's time; the JSON cache."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import pytest
import torch

from cost_models import profile
from cost_models.errors import ProfileError
from cost_models.profiling import co_running
from examples.models.gpt import gpt
from examples.models.resnet import resnet50
from examples.models.wrn import wrn


def _whole_model_ms(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], repeats: int = 7) -> float:
    def once() -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model(*inputs).float().sum().backward()
        return (time.perf_counter() - start) * 1e3
    for _ in range(2):
        once()
    return statistics.median(once() for _ in range(repeats))


@pytest.mark.parametrize("name", ["wrn", "gpt"])
def test_node_times_sum_to_whole_model_time(name: str) -> None:
    if name == "wrn":
        model, inputs = wrn(depth=16, widen_factor=4, device="cpu"), (torch.randn(8, 3, 32, 32),)
    else:
        model = gpt(hidden=256, layers=4, heads=4, seq_len=128, vocab=2048, device="cpu")
        inputs = (torch.randint(0, 2048, (4, 128)),)
    ratios = []
    for _ in range(5):  # fresh, independent measurements if a neighbour process or the machine disturbed one
        table = profile(model, inputs, "cpu", repeats=5)
        # the output node carries the training loss, which the reference below does not run
        nodes_ms = sum(cost.fwd_ms + cost.bwd_ms for cost in table.values() if cost.name != "output")
        ratios.append(nodes_ms / _whole_model_ms(model, inputs))
        if abs(ratios[-1] - 1) <= 0.15:
            break
    assert abs(ratios[-1] - 1) <= 0.15, f"per-node sum / whole-model time = {ratios}"
    assert table.source == "measured" and max(cost.fwd_ms for cost in table.values()) > 0


def test_the_profile_times_the_training_loss_on_the_output_node() -> None:
    """The output node carries the loss's forward and backward (cost_models/loss.py), timed on the real
    logits: within a factor of three of an independent timing of the same cross-entropy."""
    model = torch.nn.Sequential(torch.nn.Embedding(4096, 64), torch.nn.Linear(64, 4096))
    tokens = torch.randint(0, 4096, (8, 64))
    table = profile(model, (tokens,), "cpu", repeats=5)
    logits = model(tokens).detach().requires_grad_(True)
    targets = torch.zeros(8 * 64, dtype=torch.long)

    def loss_ms() -> float:
        start = time.perf_counter()
        torch.nn.functional.cross_entropy(logits.reshape(-1, 4096), targets).backward()
        return (time.perf_counter() - start) * 1e3
    independent = statistics.median(loss_ms() for _ in range(9))
    measured = table["output"].fwd_ms + table["output"].bwd_ms
    assert independent / 3 < measured < 3 * independent, (measured, independent)
    assert table["output"].bwd_ms > 0


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.skipif(not Path("/proc/self/stat").exists() or len(os.sched_getaffinity(0)) < 2,
                    reason="needs /proc and two cores")
def test_co_runners_train_on_their_own_cores_while_the_whole_graph_is_timed_and_are_gone_after() -> None:
    """The profiling process and its copy sit on the shares of the cores that the runtime binds two local ranks
    to (cost_models.cpu_device.rank_cores: on 16 cores, 0-7 and 8-15), not on two neighbouring cores."""
    from cost_models.cpu_device import rank_cores

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    cores = os.sched_getaffinity(0)
    with co_running(model, (torch.randn(64, 256),), 1) as pids:
        assert len(pids) == 1
        mine, theirs = os.sched_getaffinity(0), os.sched_getaffinity(pids[0])
        assert mine == set(rank_cores(sorted(cores), 0, 2)) and theirs == set(rank_cores(sorted(cores), 1, 2))
        assert not mine & theirs
        before = _cpu_seconds(pids[0])
        time.sleep(0.5)
        assert _cpu_seconds(pids[0]) - before > 0.2  # it computes, it does not wait
    assert not Path(f"/proc/{pids[0]}").exists()
    assert os.sched_getaffinity(0) == cores


def test_a_cpu_plan_profiles_beside_the_nodes_other_ranks(tmp_path, monkeypatch) -> None:
    """plan(device="cpu") on two ranks times the graph with one copy training beside it, at each micro-batch
    size it considers (the cache files say)."""
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    from planner import plan
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    plan(model, gpus=2, mem="1GB", batch_size=8, device="cpu", example_inputs=torch.randn(1, 64),
         num_stages=[1], data_parallel=[2])
    ranks = min(2, len(os.sched_getaffinity(0)))
    names = [path.name for path in (tmp_path / "profiles").iterdir()]
    assert names and all(name.endswith(f"-x{ranks}.json") if ranks > 1 else "-x" not in name for name in names)


def test_profile_leaves_model_state_untouched() -> None:
    model = resnet50(width=8, device="cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    profile(model, (torch.randn(2, 3, 32, 32),), "cpu", warmup=1, repeats=2)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())


def test_cache_is_keyed_by_fingerprint_and_reused(tmp_path) -> None:
    model = resnet50(width=8, device="cpu")
    inputs = (torch.randn(2, 3, 32, 32),)
    first = profile(model, inputs, "cpu", warmup=0, repeats=1, cache_dir=tmp_path)
    [cache_file] = tmp_path.iterdir()
    assert cache_file.name.startswith(first.fingerprint[:24]) and "cpu-float32" in cache_file.name
    data = json.loads(cache_file.read_text())
    data["nodes"]["conv1"]["fwd_ms"] = 123.0  # proves the second call reads the file
    cache_file.write_text(json.dumps(data))
    assert profile(model, inputs, "cpu", cache_dir=tmp_path)["conv1"].fwd_ms == 123.0
    assert profile(model, inputs, "cpu", warmup=0, repeats=1, cache_dir=tmp_path,
                   refresh=True)["conv1"].fwd_ms != 123.0
    cache_file.write_text("{not json")
    assert profile(model, inputs, "cpu", warmup=0, repeats=1, cache_dir=tmp_path)["conv1"].fwd_ms < 123.0


def test_meta_models_cannot_be_profiled() -> None:
    with pytest.raises(ProfileError, match="meta"):
        profile(resnet50(width=8), (torch.empty(2, 3, 32, 32, device="meta"),), "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_gpu_profile_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(ProfileError, match="CUDA is not available"):
        profile(resnet50(width=8, device="cpu"), (torch.randn(2, 3, 32, 32),), "A100-80GB")


def test_node_times_are_scaled_to_the_whole_graph_keeping_each_nodes_share() -> None:
    """Alone, a: 1 ms forward and 2 ms backward, b: 3 ms and none; the whole graph measured 8 ms forward and
    1 ms backward: a takes a quarter of the forward (2 ms) and all of the backward, b stays without one."""
    from cost_models.profiling import NodeTiming, in_context

    scaled = in_context({"a": NodeTiming(1.0, 2.0), "b": NodeTiming(3.0, 0.0)}, 8.0, 1.0)
    assert scaled == {"a": NodeTiming(2.0, 1.0), "b": NodeTiming(6.0, 0.0)}
    # a split backward's I and W scale as the backward does (a: halved)
    split = in_context({"a": NodeTiming(1.0, 2.0, split_ms=(1.5, 1.0))}, 1.0, 1.0)
    assert split == {"a": NodeTiming(1.0, 1.0, split_ms=(0.75, 0.5))}
    # a graph without a backward keeps its node times' backward as measured alone (nothing to scale to)
    assert in_context({"a": NodeTiming(1.0, 2.0)}, 1.0, 0.0) == {"a": NodeTiming(1.0, 2.0)}


def test_split_halves_are_scaled_to_the_graphs_own_split_backward_after_its_first_node() -> None:
    """The graph after its first node (emb) split its backward into I 5 ms and W 1.5 ms. Of the nodes after
    emb, lin alone took I 1 and W 3, act (no weights) and out (the loss) 2 and 1 of backward, which stay (the
    whole backward is 9 ms, as alone): so lin's I becomes 5 - 3 = 2 ms and its W 1.5 ms, and the stage after
    emb is predicted I = 2 + 2 + 1 = 5 ms and W = 1.5 ms, what it measured. Without that split's cut among
    the nodes, the halves scale as the backward."""
    from cost_models.profiling import NodeTiming, WholeSplit, in_context

    alone = {"emb": NodeTiming(1.0, 2.0), "lin": NodeTiming(1.0, 4.0, split_ms=(1.0, 3.0)),
             "act": NodeTiming(1.0, 2.0), "out": NodeTiming(0.0, 1.0)}
    scaled = in_context(alone, 3.0, 9.0, WholeSplit("emb", input_ms=5.0, weight_ms=1.5))
    assert scaled["lin"] == NodeTiming(1.0, 4.0, split_ms=(2.0, 1.5))
    for name in ("emb", "act", "out"):  # the backward's scale is 1: as measured alone
        assert scaled[name] == alone[name]
    assert in_context(alone, 3.0, 18.0, WholeSplit("elsewhere", 5.0, 1.5))["lin"].split_ms == (2.0, 6.0)


def test_a_split_backwards_weight_groups_each_pay_a_fixed_cost_beside_their_nodes_share() -> None:
    """W runs one backward per weight group. After emb, a head (W alone 3 ms) and a norm (W alone 0 ms: its
    work is under what starting a backward costs) split their backward; the whole backward scales by 2 (4 ms
    alone, 8 ms whole) and the whole split's W took 10 ms: 2 x 3 = 6 ms of it the head's weight half in
    context, the other 4 ms two groups' own calls, 2 ms each. So the head's W is 6 + 2 = 8 ms and the norm's
    2 ms, where scaling both by 10 / 3 would give the head all 10 and the norm none. A whole W under the
    weight halves in context scales them alone."""
    from cost_models.profiling import NodeTiming, WholeSplit, in_context

    alone = {"emb": NodeTiming(1.0, 1.0), "head": NodeTiming(1.0, 3.0, split_ms=(1.0, 3.0)),
             "norm": NodeTiming(1.0, 0.0, split_ms=(0.5, 0.0))}
    scaled = in_context(alone, 3.0, 8.0, WholeSplit("emb", input_ms=3.0, weight_ms=10.0))
    assert scaled["head"].split_ms[1] == pytest.approx(8.0) and scaled["norm"].split_ms[1] == pytest.approx(2.0)
    assert sum(scaled[name].split_ms[1] for name in ("head", "norm")) == pytest.approx(10.0)
    quick = in_context(alone, 3.0, 8.0, WholeSplit("emb", input_ms=3.0, weight_ms=4.5))
    assert (quick["head"].split_ms[1], quick["norm"].split_ms[1]) == pytest.approx((4.5, 0.0))


def test_nodes_of_one_signature_pool_their_samples_so_a_slow_spell_over_one_is_outvoted() -> None:
    """A node timed while another process took its core for most of its rounds (a GPT-2's first attention's
    backward came out 40x its second's, and the plan cut after it) gets the median of every node of its
    signature; a node of its own, or one whose signature cannot be told, keeps its own samples."""
    from cost_models.profiling import _NodeSamples, _pooled, _Sample

    def node(bwd_ms: list[float]) -> _NodeSamples:
        samples = _NodeSamples()
        for value in bwd_ms:
            samples.add(_Sample(1.0, value, None, None, None), kept=True, split_kept=False)
        return samples
    samples = {"attn": node([9.0, 9.5, 1.0, 8.0, 1.1]), "attn_1": node([1.0, 1.2, 0.9, 1.1, 1.0]),
               "attn_2": node([1.1, 0.9, 1.0, 1.2, 1.0]), "head": node([2.0, 9.0, 8.0, 9.0, 2.0]),
               "user": node([5.0, 5.0, 6.0])}
    signatures = {"attn": ("sdpa", (4, 32)), "attn_1": ("sdpa", (4, 32)), "attn_2": ("sdpa", (4, 32)),
                  "head": ("linear", (4, 512)), "user": None}
    pooled = {name: record.timing(0.0).bwd_ms for name, record in _pooled(samples, signatures).items()}
    assert statistics.median([9.0, 9.5, 1.0, 8.0, 1.1]) == 8.0  # alone, the slow spell wins
    assert pooled["attn"] == pooled["attn_1"] == pooled["attn_2"] == statistics.median(
        [9.0, 9.5, 1.0, 8.0, 1.1, 1.0, 1.2, 0.9, 1.1, 1.0, 1.1, 0.9, 1.0, 1.2, 1.0]) == 1.1
    assert (pooled["head"], pooled["user"]) == (8.0, 5.0)


def test_a_split_backward_is_timed_where_inputs_and_weights_both_take_gradients() -> None:
    """ZB-H1 runs a backward as I (into the inputs) and, later, W (into the weights). Both are timed for a
    node with weights whose inputs carry a gradient; a first layer (its input is data) and a node without
    weights have none. W is what the node's weight gradient costs; what I + W take beyond the whole
    backward is the node's split_extra_ms; layers of one type and shape share one timing."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 256))  # I and W well above a call's cost
    table = profile(model, (torch.randn(128, 256),), "cpu", warmup=1, repeats=2)
    first, relu, second, _, third = (table[name] for name in ("_0", "_1", "_2", "_3", "_4"))
    assert first.split_ms is None and relu.split_ms is None
    assert first.split_extra_ms == 0.0 and first.weight_grad_ms == first.bwd_ms  # nothing flows into data
    assert second.split_ms is not None and min(second.split_ms) > 0
    assert third.split_ms == second.split_ms  # the same layer on the same shapes: timed once
    assert second.weight_grad_ms == second.split_ms[1]
    assert second.split_extra_ms == pytest.approx(max(0.0, sum(second.split_ms) - second.bwd_ms))

    class FunctionalHead(torch.nn.Module):  # a weight read by a function (get_attr), as tied heads and exports do
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = torch.nn.Linear(64, 64), torch.nn.Parameter(torch.randn(64, 64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(torch.relu(self.body(x)), self.head)

    functional = profile(FunctionalHead(), (torch.randn(32, 64),), "cpu", warmup=1, repeats=2)
    assert functional["linear"].split_ms is not None and functional["body"].split_ms is None


class _Spell:
    """The machine slowing down for a while: forward calls ``start`` to ``start + length`` take 3x as long."""

    def __init__(self, start: int, length: int) -> None:
        self.start, self.length, self.calls, self.slowed = start, length, 0, 0

    def factor(self) -> int:
        self.calls += 1
        inside = self.start <= self.calls < self.start + self.length
        self.slowed += inside
        return 3 if inside else 1


class _Layer(torch.nn.Module):
    """1 ms of work a forward (a sleep: exact, and no load on the machine), 3 ms during the spell."""

    def __init__(self, spell: _Spell) -> None:
        super().__init__()
        self.spell, self.linear = spell, torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(1e-3 * self.spell.factor())
        return self.linear(x)


def test_a_slow_spell_of_the_machine_does_not_skew_the_nodes_it_falls_on() -> None:
    """Twelve identical layers; while they are profiled the machine runs 3x slower for 20 forward calls, three
    layers' worth of back-to-back samples. The profile samples each node once per round over the graph
    (and runs the whole graph once after each), so the spell costs a node at most one of its five samples:
    the layers keep equal times (to 20%), where timing each node's seven samples back to back made those
    under the spell 2.8x slower than the rest."""
    spell = _Spell(start=70, length=20)
    model = torch.nn.Sequential(*(_Layer(spell) for _ in range(12)))
    table = profile(model, (torch.randn(4, 16),), "cpu", warmup=2, repeats=5, leaf_modules=(_Layer,))
    times = [table[f"_{index}"].fwd_ms for index in range(12)]
    assert spell.slowed == 20
    assert max(times) / min(times) < 1.2, times


class _BigThenSmall(torch.nn.Module):
    """One large layer, then 150 reshapes of its output: nodes whose backward is next to nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Linear(512, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.big(x)
        for _ in range(50):
            h = h.transpose(0, 1).view(512, -1).transpose(0, 1)
        return h


def test_many_small_nodes_do_not_take_a_large_nodes_share_of_the_backward() -> None:
    """A backward started alone costs some 20 us before any work, which a whole pass pays once. Counted in each
    of 150 small nodes' times it made them 3 ms where they take 0.5, and scaled to the whole pass the large
    layer's backward came out 60% short. Less that cost, the layer's backward is what it takes timed directly
    (within 20%: 0.82-1.00 of it here)."""
    model, x = _BigThenSmall(), torch.randn(256, 512)

    def direct_ms() -> float:
        def once() -> float:
            out = model.big(x)
            start = time.perf_counter()
            torch.autograd.grad(out, list(model.big.parameters()), torch.ones_like(out))
            return (time.perf_counter() - start) * 1e3
        return statistics.median(once() for _ in range(9))

    ratios = []
    for _ in range(3):  # fresh measurements if the machine disturbed one
        ratios.append(profile(model, (x,), "cpu", warmup=2, repeats=5)["big"].bwd_ms / direct_ms())
        if abs(ratios[-1] - 1) <= 0.2:
            break
    assert abs(ratios[-1] - 1) <= 0.2, ratios
