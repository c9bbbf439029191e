"""The plan's predicted peak against the search's memory bound, at the smallest budget the search accepts.

The search bounds each rank's memory by every saved activation beside its stages' largest working sets, with
the gradients (planner/search/terms.py); the plan counts each stage node by node (planner/search/working.py),
which must never come out above that bound. For small GPT, ResNet and U-Net models on an A100 preset, the five
synchronous families, 2 and 4 GPUs, SGD with momentum and Adam, fp32 and bf16: the smallest budget
the search accepts (what PlanInfeasible names), the plan made at it, and its predicted peak as a share of
it. Prints each group's range and every plan above its budget (there should be none).

Run: python benchmarks/memory_bound.py
"""

from __future__ import annotations

import collections
import itertools
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cost_models.errors import InvalidArgument, PlanInfeasible  # noqa: E402
from examples.models.gpt import gpt  # noqa: E402
from examples.models.resnet import resnet50  # noqa: E402
from examples.models.unet import unet_small  # noqa: E402
from planner import plan  # noqa: E402

FAMILIES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "gems-master")


def models() -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    tokens = torch.zeros((2, 32), dtype=torch.int64, device="meta")
    return {"gpt": (gpt(hidden=64, layers=4, heads=4, seq_len=32, vocab=512, dropout=0.0), tokens),
            "gpt, 8k vocabulary": (gpt(hidden=64, layers=2, heads=4, seq_len=16, vocab=8192, dropout=0.0),
                                   torch.zeros((2, 16), dtype=torch.int64, device="meta")),
            "resnet": (resnet50(width=8, num_classes=10), torch.zeros(2, 3, 64, 64, device="meta")),
            "unet": (unet_small(), torch.zeros(2, 3, 64, 64, device="meta"))}


def main() -> None:
    warnings.simplefilter("ignore")
    shares: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    above = []
    cases = list(itertools.product(models().items(), FAMILIES, (2, 4), ("momentum", "adam"), ("fp32", "bf16")))
    print(f"planning {len(cases)} cases at the smallest budget each accepts (a minute or two)", flush=True)
    for index, ((name, (model, batch)), family, gpus, optimizer, precision) in enumerate(cases):
        if index == 0 or cases[index - 1][0][0] != name:
            print(f"  {name}: from case {index + 1}", flush=True)
        arguments = {"batch_size": 8, "example_inputs": batch, "device": "A100-40GB", "optimizer": optimizer,
                     "precision": precision, "schedules": [family], "offload": False, "spatial": False,
                     "reserve": 0}
        try:
            plan(model, gpus, 1000, **arguments)
            continue  # (never: nothing fits 1000 bytes)
        except InvalidArgument:
            continue  # the family cannot use this many GPUs or micro-batches
        except PlanInfeasible as infeasible:
            smallest = infeasible.min_mem_bytes
        share = max(plan(model, gpus, smallest, **arguments).predicted.peak_mem_bytes) / smallest
        shares[optimizer, precision].append(share)
        if share > 1:
            above.append(f"{name}, {family}, {gpus} GPUs, {optimizer}, {precision}: {share:.1%} of its budget")
    print(f"{sum(map(len, shares.values()))} plans at the smallest budget the search accepts; predicted peak as a "
          "share of that budget:")
    for (optimizer, precision), values in sorted(shares.items()):
        print(f"  {optimizer:<9} {precision}: {len(values):>3} plans, {min(values):.0%} .. {max(values):.0%}")
    print("above the budget: " + ("none" if not above else "; ".join(above)))


if __name__ == "__main__":
    main()
