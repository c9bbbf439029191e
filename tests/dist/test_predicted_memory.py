"""Each rank's peak memory as a plan predicts it, against the run's: plans made by ``tessera plan --device cpu``
(node times and each node's backward allocations profiled here), run by ``tessera run`` on 2 gloo ranks. The
run report's peak is the CPU meter's: the allocations of the profiled last step, on top of the model state
(runtime/memory.py). The plan counts each stage node by node (planner/search/working.py); before it did, the
GPT's first stage came out 5.5% and the U-Net's second 6.7% above the measured peak. ZB-H1's last stage
measured 21% above its plan before the plan counted what its I keeps for its W; its last stage came out 5.8% above
the run, and a 4-rank ResNet's middle stage ran above the search's bound, while the plan counted a W's working set
as its new weight gradients alone and the simulator put the whole transient back at each W's start.
"""

from __future__ import annotations

import pytest

from planner.plan import ParamTier, Plan
from planner.reports.run_report import RunReport
from tests.dist.test_tessera_run import tessera

pytestmark = pytest.mark.dist

GPT = ["examples/models/gpt.py:gpt", "--model-arg", "hidden=128", "--model-arg", "layers=4", "--model-arg", "heads=4",
       "--model-arg", "seq_len=64", "--model-arg", "vocab=2048", "--model-arg", "dropout=0.0",
       "--model-arg", "tie_embeddings=false", "--input", "64:int64", "--schedule", "1f1b", "--batch-size", "8"]
UNET = ["examples/models/unet.py:unet_small", "--input", "3x64x64", "--schedule", "1f1b", "--batch-size", "8"]
GPT_ZB = [*GPT[:-4], "--schedule", "zb-h1", "--batch-size", "16"]  # its I keeps the logits' gradient for its W
RESNET = ["examples/models/resnet.py:resnet50", "--model-arg", "width=8", "--model-arg", "num_classes=10",
          "--input", "3x64x64", "--schedule", "gpipe", "--batch-size", "16", "--micro-batch-size", "4"]


RESNET_ZB = [*RESNET[:5], "--input", "3x256x256", "--schedule", "zb-h1", "--batch-size", "2"]  # a middle stage's W
GPT_GEMS_TIED = [*GPT[:13], "--model-arg", "tie_embeddings=true", "--input", "64:int64", "--schedule", "gems-master",
                 "--batch-size", "8"]  # each rank holds the first part of one copy and the last of the other: one
# embedding tensor for both (runtime/stages.py: local_stages); the plan counted it twice, 10% over the run


@pytest.mark.parametrize(("model", "ranks"), [(GPT, 2), (GPT_ZB, 2), (UNET, 2), (RESNET, 2), (RESNET_ZB, 3),
                                              (GPT_GEMS_TIED, 2)],
                         ids=["gpt 1f1b", "gpt zb-h1", "unet 1f1b", "resnet gpipe", "resnet zb-h1 3 ranks",
                              "tied gpt gems-master"])
def test_each_ranks_measured_peak_is_the_plans_within_5_percent(model: list[str], ranks: int, tmp_path) -> None:
    plan_file, report_file = tmp_path / "plan.json", tmp_path / "report.json"
    planned = tessera("plan", *model, "--gpus", str(ranks), "--mem", "8GB", "--device", "cpu",
                      "--num-stages", str(ranks),
                      "--optimizer", "momentum", "--no-offload", "--no-spatial", "-o", str(plan_file), "-q")
    assert planned.returncode == 0, planned.stderr
    ran = tessera("run", str(plan_file), "--steps", "2", "--", "--report", str(report_file))
    assert ran.returncode == 0, ran.stderr
    predicted = Plan.load(plan_file).predicted.peak_mem_bytes
    measured = RunReport.load(report_file).peak_mem_bytes
    errors = [m / p - 1 for m, p in zip(measured, predicted)]
    print(" ".join(f"rank {rank}: {p:,} B predicted, {m:,} measured ({e:+.1%})"
                   for rank, (p, m, e) in enumerate(zip(predicted, measured, errors))))
    assert all(abs(error) <= 0.05 for error in errors), (predicted, measured, errors)


GPT_WIDE = ["examples/models/gpt.py:gpt", "--model-arg", "hidden=256", "--model-arg", "layers=4", "--model-arg",
            "heads=4", "--model-arg", "seq_len=16", "--model-arg", "vocab=512", "--model-arg", "dropout=0.0",
            "--model-arg", "tie_embeddings=false", "--input", "16:int64", "--schedule", "gpipe", "--batch-size", "4"]
# 3.4M parameters: 13 MB of weights, as much of gradients and of momentum, beside well under 1 MB of activations
GPT_LONG = [{"seq_len=16": "seq_len=64", "16:int64": "64:int64"}.get(arg, arg) for arg in GPT_WIDE[:-1]] + ["8"]
# the same weights at 4 times the sequence and twice the batch: 17 MB of activations as well


@pytest.mark.parametrize(("model", "share", "offload", "params"), [
    (GPT_WIDE, 0.8, ["zero"], ParamTier.GPU), (GPT_WIDE, 0.45, ["zero", "host", "params"], ParamTier.HOST),
    (GPT_LONG, 0.7, ["zero", "recompute"], ParamTier.GPU)],
    ids=["zero-3", "zero-3 params and optimizer on host", "zero-3 and recompute"])
def test_a_searched_zero_3_plan_gathers_layer_by_layer_and_peaks_as_planned(model: list[str], share: float,
                                                                            offload: list[str], params: ParamTier,
                                                                            tmp_path) -> None:
    """One stage x 2 replicas of a GPT whose model state is what fills memory. At 80% of what the plan keeping it
    whole needs, neither that nor ZeRO-1 (the optimizer's momentum halved) fits, ZeRO-3 does (weights and
    gradients halved, its largest gather group whole beside them: runtime/layer_gathers.py). At 45%, with the
    optimizer and the parameters allowed on the host, ZeRO-Infinity's plan: the momentum and the weights' shards
    on the host, only the gradients' shards and a layer's gathers on the device. At 70% of a longer sequence's,
    ZeRO-3 and checkpoint regions, inside which the layers gather in groups too (whole runs gathered at once there
    before, which this missed). Each rank's peak is measured
    within 10% of its plan and under the budget; the host holds the weights' shards beside the optimizer's state.
    Measured 1.7%, 3.5% and 7.2% under the plans, their layers gathered in groups that the memory left allows
    (planner/gathers.py) (10%, not 5%: the plan counts three copies of the largest group's weights at every
    moment, planner/search/terms.py gathered_layer_copies, which the runtime holds together only around that
    group's gathers and backward; it counted five, and measured 2.8%, 5.3% and 6.5% under, while the runtime kept
    its collectives' buffers between them). Before gloo's reduce-scatter was replaced by an in-place all-reduce for
    these (runtime/sharding.py), its temporaries, often freed on gloo's worker thread where the CPU meter does not
    see them, put the measured peaks anywhere from 3% under to 21% over the plan, run to run."""
    whole_file, plan_file, report_file = tmp_path / "whole.json", tmp_path / "plan.json", tmp_path / "report.json"
    common = ["--gpus", "2", "--device", "cpu", "--num-stages", "1", "--optimizer", "momentum", "--no-spatial", "-q"]
    planned = tessera("plan", *model, *common, "--mem", "8GB", "--no-offload", "-o", str(whole_file))
    assert planned.returncode == 0, planned.stderr
    whole = Plan.load(whole_file)
    budget = int(share * max(whole.predicted.peak_mem_bytes))
    kinds = [argument for kind in offload for argument in ("--offload", kind)]
    planned = tessera("plan", *model, *common, "--mem", f"{budget}B", *kinds, "-o", str(plan_file))
    assert planned.returncode == 0, planned.stderr
    sharded = Plan.load(plan_file)
    spec = sharded.stages[0].offload
    assert spec.zero_stage == 3 and spec.params is params, str(sharded)
    assert 0 < len(spec.gathers) < 28, spec.gathers  # (its 28 layers in groups: planner/gathers.py)
    assert bool(spec.recompute) == ("recompute" in offload), str(sharded)
    ran = tessera("run", str(plan_file), "--steps", "2", "--", "--report", str(report_file))
    assert ran.returncode == 0, ran.stderr
    report = RunReport.load(report_file)
    predicted, measured = sharded.predicted.peak_mem_bytes, report.peak_mem_bytes
    errors = [m / p - 1 for m, p in zip(measured, predicted)]
    print(" ".join(f"rank {rank}: {p:,} B predicted, {m:,} measured ({e:+.1%})"
                   for rank, (p, m, e) in enumerate(zip(predicted, measured, errors))), f"budget {budget:,} B")
    assert all(abs(error) <= 0.10 for error in errors), (predicted, measured, errors)
    assert max(measured) <= budget
    if params is ParamTier.HOST:  # between steps: half of the masters, of the momentum and of the weights (fp32, as
        # many elements each; the plan's host bytes add the step's half of the gradients)
        half = sharded.stages[0].predicted.param_bytes // 2
        assert report.optimizer_host_bytes == (3 * half, 3 * half), (report.optimizer_host_bytes, half)
        assert sharded.stages[0].predicted.host_bytes == 4 * half
