"""runtime/precision.py without processes: the loss scale against torch.amp.GradScaler, masters, casts."""

from __future__ import annotations

import inspect
import json
import math

import pytest
import torch
from torch import nn

from cost_models.memory import Precision, step_buckets
from planner.plan import OffloadSpec, Plan
from planner.preflight import build_dtype, rebuild_model, trace_checked
from runtime import checks
from runtime.precision import (
    LossScaler,
    MixedPrecision,
    ScalerOptions,
    cast_model,
    compute_dtype,
    fp32_copies,
)
from runtime.stage_optimizer import StageOptimizer, copied_into_new
from runtime.stages import LocalStage
from tests.runtime_plans import GPT, make_plan


def test_the_scaler_defaults_are_grad_scalers() -> None:
    defaults = {name: p.default for name, p in inspect.signature(torch.amp.GradScaler.__init__).parameters.items()}
    options = ScalerOptions()
    assert (options.init_scale, options.growth_factor, options.backoff_factor, options.growth_interval) == (
        defaults["init_scale"], defaults["growth_factor"], defaults["backoff_factor"], defaults["growth_interval"])


def test_the_loss_scale_moves_as_grad_scalers_does() -> None:
    """The same overflow pattern through GradScaler (one local optimizer) and LossScaler."""
    options = ScalerOptions(init_scale=2.0 ** 10, growth_interval=2)
    ours = LossScaler(options, torch.device("cpu"))
    theirs = torch.amp.GradScaler("cpu", init_scale=options.init_scale, growth_interval=options.growth_interval)
    param = nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([param], lr=1.0)
    theirs.scale(torch.ones(()))  # GradScaler creates its scale lazily
    for overflow in [False, True, False, False, False, True, True, False, False]:
        grad = torch.tensor([1.0, math.inf if overflow else 2.0, 3.0])
        param.grad = grad.clone() * theirs.get_scale()
        theirs.step(optimizer)
        theirs.update()
        mine = grad.clone() * ours.scale
        found_inf = ours.unscale_([mine])
        ours.update(found_inf)
        assert found_inf.item() == float(overflow)
        assert ours.scale.item() == theirs.get_scale()
        if not overflow:
            assert torch.equal(mine, grad)  # unscaled exactly (powers of two)
    restored = torch.amp.GradScaler("cpu")
    restored.load_state_dict(ours.state_dict())
    assert restored.state_dict() == theirs.state_dict()


def _stage(*params: nn.Parameter) -> LocalStage:
    return LocalStage(0, 0, torch.fx.symbolic_trace(nn.Identity()), None,  # type: ignore[arg-type]
                      {f"p{i}": p for i, p in enumerate(params)}, {}, None)


def test_bf16_steps_fp32_masters_without_a_scale_and_rounds_them_into_the_weights() -> None:
    weight = nn.Parameter(torch.tensor([1.0, 2.0 ** -12, 3.0]))
    stage = _stage(weight)
    sources = fp32_copies({0: stage})[0]
    weight.data = weight.data.to(torch.bfloat16)  # cast_model
    stage.state = StageOptimizer(0, stage.params, lambda ps: torch.optim.SGD(ps, lr=1.0), spec=OffloadSpec(),
                                 device=torch.device("cpu"), sources=sources)
    mixed = MixedPrecision(Precision.BF16, {0: stage.state}, stepped={0}, device=torch.device("cpu"),
                           timeout_s=10)
    master = stage.state.masters[0]
    assert master.dtype == torch.float32 and master is not weight and stage.optimizer is not None
    assert stage.optimizer.param_groups[0]["params"] == [master]
    assert mixed.scale_loss(torch.tensor(3.0)).item() == 3.0 and mixed.loss_scale == 1.0
    weight.grad = torch.tensor([2.0 ** -20, 0.0, 1.0], dtype=torch.bfloat16)
    mixed.step(0)
    assert master.tolist() == [1.0 - 2.0 ** -20, 2.0 ** -12, 2.0]  # fp32 keeps the tiny update
    assert weight.dtype == torch.bfloat16 and weight.tolist() == [1.0, 2.0 ** -12, 2.0]  # rounded copy
    assert weight.grad is None and master.grad is None
    with pytest.raises(RuntimeError, match="OPTIMIZER_STEP of stage 3"):
        mixed.step(3)


def test_gradients_go_down_in_buckets_of_one_buffer_per_dtype_as_single_casts_would() -> None:
    grads = [torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(5, dtype=torch.bfloat16),
             torch.randn(2, 2, dtype=torch.float64)]
    cpu = torch.device("cpu")
    targets = [(torch.Size([12]), torch.float32, cpu), (torch.Size([5]), torch.float64, cpu),
               (torch.Size([4]), torch.float64, cpu)]
    copies = copied_into_new(grads, targets)
    for grad, (shape, dtype, _), copy in zip(grads, targets, copies):
        assert copy.dtype == dtype and copy.shape == shape
        assert torch.equal(copy, grad.to(dtype).reshape(shape))
    assert copies[1].untyped_storage().data_ptr() == copies[2].untyped_storage().data_ptr()  # one fp64 buffer
    assert step_buckets([4, None, 4, 8, 1, None], 8) == [[0, 2], [3], [4]]
    assert step_buckets([None, None], 8) == []
    assert step_buckets([2, 9, 2], 6) == [[0], [1], [2]]  # no bucket grows past the limit, but one parameter alone


@pytest.mark.parametrize("mixed", [False, True])
def test_a_step_in_buckets_equals_one_step_over_every_parameter(mixed: bool,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.stage_optimizer

    monkeypatch.setattr(runtime.stage_optimizer, "step_bucket_bytes", lambda total: 1)  # a bucket per parameter
    torch.manual_seed(0)
    start = [torch.randn(shape, dtype=torch.float64) for shape in ((4, 3), (5,), (2,))]
    dtype = torch.bfloat16 if mixed else torch.float64
    params = {f"p{i}": nn.Parameter(t.clone().to(dtype)) for i, t in enumerate(start)}
    state = StageOptimizer(0, params, lambda ps: torch.optim.Adam(ps, lr=0.1), spec=OffloadSpec(),
                           device=torch.device("cpu"), sources=[t.float() for t in start] if mixed else None)
    reference = [nn.Parameter(t.float() if mixed else t.clone()) for t in start]
    optimizer = torch.optim.Adam(reference, lr=0.1)
    for step in range(3):
        grads = [torch.randn_like(t) for t in start]
        for param, grad in zip(params.values(), grads):
            param.grad = grad.to(param.dtype)
        for param, grad in zip(reference, grads):
            param.grad = grad.to(param.dtype).to(torch.bfloat16).float() if mixed else grad.clone()
        state.step()
        optimizer.step()
        for master, param, expected in zip(state.masters, params.values(), reference):
            assert torch.equal(master.detach(), expected.detach()), step
            assert torch.equal(param.detach(), expected.detach().to(param.dtype)) and param.grad is None


def test_mixed_plans_rebuild_a_float32_model_the_runtime_casts() -> None:
    plan = Plan.from_dict(json.loads(make_plan(GPT, ["blocks_1_ln_1"], schedule="1f1b", precision="fp16")))
    assert build_dtype(plan.model.precision) == torch.float32 and compute_dtype(plan.model.precision) == torch.float16
    checks.check_executable(plan)  # mixed precision is executed
    model = rebuild_model(plan)
    trace_checked(model, plan)  # the fingerprint is the float32 model's
    cast_model(model, plan.model.precision)
    assert {p.dtype for p in model.parameters()} == {torch.float16}
