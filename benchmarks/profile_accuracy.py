"""How well per-node profiled CPU times add up to timing the whole model's forward+backward.

Run: python benchmarks/profile_accuracy.py   (one intra-op thread; target: ratio within 1 +- 0.15)
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cost_models import profile  # noqa: E402
from examples.models.amoebanet import amoebanet_d  # noqa: E402
from examples.models.gpt import gpt  # noqa: E402
from examples.models.resnet import resnet50  # noqa: E402
from examples.models.unet import unet  # noqa: E402
from examples.models.wrn import wrn  # noqa: E402

CASES: dict[str, Callable[[], tuple[torch.nn.Module, torch.Tensor]]] = {
    "resnet50 w32 64px b8": lambda: (resnet50(width=32, device="cpu"), torch.randn(8, 3, 64, 64)),
    "wrn-16-4 32px b8": lambda: (wrn(depth=16, widen_factor=4, device="cpu"), torch.randn(8, 3, 32, 32)),
    "amoebanet-d(6,64) 64px b4": lambda: (amoebanet_d(num_layers=6, num_filters=64, num_classes=10,
                                                     device="cpu"), torch.randn(4, 3, 64, 64)),
    "gpt h256 L4 s128 b4": lambda: (gpt(hidden=256, layers=4, heads=4, seq_len=128, vocab=2048,
                                        device="cpu"), torch.randint(0, 2048, (4, 128))),
    "unet w16 128px b2": lambda: (unet(base_width=16, device="cpu"), torch.randn(2, 3, 128, 128)),
}


def whole_model_ms(model: torch.nn.Module, x: torch.Tensor, repeats: int = 7) -> float:
    def once() -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model(x).float().sum().backward()
        return (time.perf_counter() - start) * 1e3
    for _ in range(2):
        once()
    return statistics.median(once() for _ in range(repeats))


def main() -> None:
    torch.set_num_threads(1)
    print(f"{'model':<28} {'nodes fwd ms':>12} {'nodes bwd ms':>12} {'whole ms':>9} {'ratio':>6}")
    for name, make in CASES.items():
        torch.manual_seed(0)
        model, x = make()
        table = profile(model, (x,), "cpu", repeats=5)
        fwd, bwd = table.total("fwd_ms"), table.total("bwd_ms")
        whole = whole_model_ms(model, x)
        print(f"{name:<28} {fwd:>12.1f} {bwd:>12.1f} {whole:>9.1f} {(fwd + bwd) / whole:>6.3f}")


if __name__ == "__main__":
    main()
