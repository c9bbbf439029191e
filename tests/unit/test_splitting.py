"""runtime/splitting.py: the rewrite older torch releases get equals split_module(..., tuple_return=True)."""

from __future__ import annotations

import torch
import torch.fx
from torch import nn
from torch.fx.passes.split_module import split_module

from runtime.splitting import split_tupled, tuple_outputs


class _Three(nn.Module):
    """Parts 0 and 2 hand one value on, part 1 two values."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).relu()
        u, v = self.b(h), h * 2
        return self.c(u + v)


def _split(model: nn.Module, tupled: bool) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    traced = torch.fx.symbolic_trace(model)
    part = {"a": 0, "relu": 0, "b": 1, "mul": 1, "add": 2, "c": 2}
    split = split_module(traced, model, lambda node: part[node.name], keep_original_node_name=True,
                         tuple_return=tupled)
    return traced, split


def test_the_rewrite_returns_tuples_like_tuple_return() -> None:
    model = _Three()
    traced, expected = _split(model, tupled=True)
    _, rewritten = _split(model, tupled=False)
    rewritten = tuple_outputs(rewritten)
    x = torch.randn(3, 4)
    torch.testing.assert_close(rewritten(x), traced(x))
    h = x
    for name in ("submod_0", "submod_1", "submod_2"):
        want, got = expected.get_submodule(name), rewritten.get_submodule(name)
        args = h if isinstance(h, tuple) else (h,)
        want_out, got_out = want(*args), got(*args)
        assert isinstance(got_out, tuple) and len(got_out) == len(want_out), name
        for a, b in zip(got_out, want_out):
            torch.testing.assert_close(a, b)
        h = got_out
    assert str(rewritten.graph).count("getitem") == str(expected.graph).count("getitem")


def test_split_tupled_runs_the_whole_model() -> None:
    model = _Three()
    traced = torch.fx.symbolic_trace(model)
    split = split_tupled(traced, model, lambda node: 0 if node.name in ("a", "relu") else 1,
                         keep_original_node_name=True)
    x = torch.randn(2, 4)
    torch.testing.assert_close(split(x), model(x))
    assert isinstance(split.get_submodule("submod_0")(x), tuple)
