"""Recompute and swap on one stage, without processes: what autograd keeps, where it keeps it, and
that gradients, dropout masks and batch-norm statistics are those of the plain stage."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx
from torch import nn

from cost_models.errors import RuntimeSetupError
from planner.plan import OffloadSpec, Plan
from runtime.build import rebuild_model, split_stages, trace_checked
from runtime.memory import storage_key
from runtime.offload import check_offload, offload_stage
from runtime.recompute import recompute
from runtime.swap import SwapSpace
from runtime.weights import initialize
from tests.runtime_plans import GPT, make_plan

MLP = ("blocks_0_ln_2", "blocks_0_mlp_fc", "blocks_0_mlp_gelu")


@pytest.fixture(scope="module")
def gpt_stage() -> torch.fx.GraphModule:
    """Stage 0 of the float64 tiny GPT cut before block 1, with real weights."""
    plan = Plan.from_dict(json.loads(make_plan(GPT, ["blocks_1_ln_1"], schedule="gpipe")))
    model = initialize(rebuild_model(plan), seed=0)
    return split_stages(trace_checked(model, plan), model, plan)[0]


def _tokens() -> torch.Tensor:
    return torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(1))


def _state_storages(module: nn.Module) -> set[int]:
    return {storage_key(t) for t in [*module.parameters(), *module.buffers()]}


def _saved_bytes(module: nn.Module, run: Callable[[], Any]) -> tuple[int, Any]:
    """Bytes of the storages autograd keeps for backward while ``run`` runs (parameters excluded)."""
    kept: dict[int, int] = {}
    state = _state_storages(module)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if storage_key(tensor) not in state:
            kept[storage_key(tensor)] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = run()
    return sum(kept.values()), result


def _grads(module: nn.Module, output: Any) -> dict[int, torch.Tensor]:
    """Gradients by parameter identity (a cut of a stage shares the stage's parameters)."""
    module.zero_grad(set_to_none=True)
    (output[0] if isinstance(output, tuple) else output).square().sum().backward()
    return {id(p): p.grad.clone() for p in module.parameters() if p.grad is not None}


def _assert_same_grads(expected: dict[int, torch.Tensor], actual: dict[int, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys()
    for key, grad in expected.items():
        torch.testing.assert_close(actual[key], grad, rtol=1e-12, atol=0)


def test_a_recomputed_region_keeps_fewer_activations_and_gives_the_same_gradients(
        gpt_stage: torch.fx.GraphModule) -> None:
    tokens = _tokens()
    plain_bytes, output = _saved_bytes(gpt_stage, lambda: gpt_stage(tokens))
    expected = _grads(gpt_stage, output)
    stage = recompute(gpt_stage, [MLP])
    assert type(stage.get_submodule("submod_1")).__name__ == "Checkpointed"
    recomputed_bytes, output = _saved_bytes(stage, lambda: stage(tokens))
    # float64 (batch, tokens, hidden) and (batch, tokens, 4 x hidden): ln_2's and fc's outputs, which
    # fc and gelu save; gelu's output stays saved (proj, outside the region, saves it)
    ln_output_bytes, fc_output_bytes = 2 * 32 * 64 * 8, 2 * 32 * 256 * 8
    assert plain_bytes - recomputed_bytes >= ln_output_bytes + fc_output_bytes
    _assert_same_grads(expected, _grads(stage, output))


def test_swapped_activations_leave_for_separate_host_tensors_and_come_back(
        gpt_stage: torch.fx.GraphModule) -> None:
    tokens = _tokens()
    plain_bytes, output = _saved_bytes(gpt_stage, lambda: gpt_stage(tokens))
    expected = _grads(gpt_stage, output)
    for prefetch in (True, False):
        space = SwapSpace(torch.device("cpu"), _state_storages(gpt_stage))
        stage = offload_stage(gpt_stage, OffloadSpec(swap=("blocks_0_attn_qkv", *MLP[1:])), space, stage=0)
        with space.forward((0, 3)):
            device_bytes, output = _saved_bytes(stage, lambda module=stage: module(tokens))
        copies = space.copies[(0, 3)]
        assert device_bytes < plain_bytes and space.step_bytes == sum(c.host.untyped_storage().nbytes()
                                                                      for c in copies) > 0
        weights = {p.untyped_storage().data_ptr() for p in gpt_stage.parameters()}  # saved, never swapped
        for swapped in copies:
            assert swapped.device_tensor is not None
            assert swapped.device_tensor.untyped_storage().data_ptr() not in weights
            assert swapped.host.untyped_storage().data_ptr() != swapped.device_tensor.untyped_storage().data_ptr()
            assert torch.equal(swapped.host, swapped.device_tensor)
        space.wait_out((0, 3))
        assert all(swapped.device_tensor is None for swapped in copies)
        if prefetch:
            space.prefetch((0, 3))
            assert all(swapped.fetched is not None for swapped in copies)
        _assert_same_grads(expected, _grads(stage, output))


class _Block(nn.Module):
    """Linear, dropout, batch-norm: random draws and running statistics inside one region."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8, dtype=torch.float64)
        self.drop = nn.Dropout(0.5)
        self.bn = nn.BatchNorm1d(8, dtype=torch.float64)
        self.act = nn.Tanh()
        self.proj = nn.Linear(8, 3, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.bn(self.drop(self.fc(x)))))


def test_recomputation_replays_dropout_and_updates_batch_norm_statistics_once() -> None:
    plain = torch.fx.symbolic_trace(_Block())
    checkpointed = recompute(copy.deepcopy(plain), [("fc", "drop", "bn", "act")])
    x = torch.randn(5, 6, dtype=torch.float64)
    probe = copy.deepcopy(plain)
    outputs = []
    for module in (plain, checkpointed):
        torch.manual_seed(11)
        output = module(x)
        torch.rand(3)  # the backward runs under another random state than the forward
        output.square().sum().backward()
        outputs.append(output)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
    torch.manual_seed(12)
    assert not torch.equal(probe(x), outputs[0])  # dropout is active: another seed, another mask
    for (name, expected), actual in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(actual.grad, expected.grad, rtol=1e-12, atol=0, msg=name)
    for (name, expected), actual in zip(plain.named_buffers(), checkpointed.buffers()):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=name)
    assert int(checkpointed.get_submodule("submod_0.region.bn").num_batches_tracked) == 1


class _InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        y.relu_()
        return self.proj(y)


@pytest.mark.parametrize(("spec", "message"), [
    (OffloadSpec(recompute=(("idx", "size"),)), r"recompute\[0\] \['idx', 'size'\] .*\['idx'\] are inputs of the stage"),
    (OffloadSpec(swap=("blocks_1_mlp_fc",)), r"swap\[0\] \['blocks_1_mlp_fc'\] .* not nodes of the stage"),
    (OffloadSpec(recompute=(("blocks_0_ln_2", "blocks_0_mlp_gelu"),)), r"recompute\[0\] .* not a run of consecutive"),
    (OffloadSpec(recompute=(MLP,), swap=("blocks_0_mlp_fc",)), r"swap\[0\] .* \['blocks_0_mlp_fc'\] are also in recompute\[0\]"),
])
def test_regions_the_stage_cannot_cut_are_refused_in_one_line_naming_them(
        gpt_stage: torch.fx.GraphModule, spec: OffloadSpec, message: str) -> None:
    with pytest.raises(RuntimeSetupError, match=f"stage 0's offload {message}") as error:
        check_offload(gpt_stage, spec, stage=0)
    assert "\n" not in str(error.value)


def test_a_region_that_modifies_its_input_in_place_is_refused() -> None:
    module = torch.fx.symbolic_trace(_InPlace())
    with pytest.raises(RuntimeSetupError, match=r"recompute\[0\] \['relu_', 'proj'\] .* inputs \['fc'\] in place"):
        recompute(module, [("relu_", "proj")], stage=2)
    recompute(module, [("fc", "relu_")], stage=2)  # modifying its own value is fine
