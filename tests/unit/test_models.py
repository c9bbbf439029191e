"""Model zoo tests: meta builds, fx tracing, closed-form parameter counts, tiny CPU forwards."""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.fx
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
ZOO = ROOT / "examples" / "models"
FAMILIES = ("resnet", "vgg", "wrn", "amoebanet", "gpt", "bert", "unet")


@functools.cache
def load(family: str) -> ModuleType:
    """Load one zoo file by path, without the package (as for ``path/file.py:builder`` specs)."""
    spec = importlib.util.spec_from_file_location(f"_zoo_test_{family}", ZOO / f"{family}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def builder(spec: str) -> Callable[..., nn.Module]:
    """Resolve ``"family:name"`` to the builder function."""
    family, name = spec.split(":")
    return getattr(load(family), name)


def count(model: nn.Module) -> int:
    """Unique parameters (tied ones once)."""
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Every public builder with the arguments used for the meta build/trace test.
META_BUILDS: list[tuple[str, dict[str, Any]]] = [
    ("resnet:resnet", {"depth": 101, "num_classes": 10}),
    ("resnet:resnet50", {}),
    ("resnet:resnet101", {}),
    ("resnet:resnet152", {}),
    ("resnet:resnet200", {}),
    ("resnet:preact_resnet", {"depth": 164}),
    ("resnet:resnet1001", {}),
    ("vgg:vgg16", {}),
    ("vgg:vgg16", {"batch_norm": True}),
    ("wrn:wrn", {"depth": 16, "widen_factor": 8, "dropout": 0.3}),
    ("wrn:wrn_28_10", {}),
    ("amoebanet:amoebanet_d", {}),
    ("gpt:gpt", {"hidden": 128, "layers": 3, "heads": 8, "seq_len": 64, "tie_embeddings": False}),
    ("gpt:gpt_tiny", {}),
    ("gpt:gpt2_small", {}),
    ("gpt:gpt2_medium", {}),
    ("gpt:megatron_1_2b", {}),
    ("gpt:megatron_2_5b", {}),
    ("gpt:megatron_8_3b", {}),
    ("gpt:gpt_50b", {}),
    ("bert:bert", {"hidden": 128, "layers": 2, "heads": 2}),
    ("bert:bert_tiny", {}),
    ("bert:bert_base", {}),
    ("bert:bert_large", {}),
    ("unet:unet", {}),
    ("unet:unet_small", {}),
]


@pytest.mark.parametrize(
    ("spec", "kwargs"), META_BUILDS, ids=lambda v: v if isinstance(v, str) else None
)
def test_builds_on_meta_and_traces(spec: str, kwargs: dict[str, Any]) -> None:
    model = builder(spec)(**kwargs)
    assert isinstance(model, nn.Module) and model.training
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(b.device.type == "meta" for b in model.buffers())
    graph_module = torch.fx.symbolic_trace(model)
    modules = dict(model.named_modules())
    called = [n.target for n in graph_module.graph.nodes if n.op == "call_module"]
    assert called, "expected leaf modules in the graph"
    for target in called:  # only standard torch.nn layers become leaves
        assert type(modules[target]).__module__.startswith("torch.nn"), target


def test_builders_are_documented() -> None:
    for spec, _ in META_BUILDS:
        doc = builder(spec).__doc__
        assert doc and "Example" in doc, spec


def test_zoo_files_are_self_contained() -> None:
    allowed = set(sys.stdlib_module_names) | {"torch"}
    for family in FAMILIES:
        tree = ast.parse((ZOO / f"{family}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0 and node.module is not None, f"{family}: relative import"
                roots = [node.module.split(".")[0]]
            elif isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            else:
                continue
            assert set(roots) <= allowed, f"{family} imports {roots}"


def test_package_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    for family in FAMILIES:
        module = importlib.import_module(f"examples.models.{family}")
        assert module.__doc__ and module.__doc__.strip()


# ---------------------------------------------------------------------------------------------
# Parameter counts against closed forms written independently of the model code.
# ---------------------------------------------------------------------------------------------


def resnet_params(blocks: tuple[int, ...], width: int, classes: int) -> int:
    total = 3 * 7 * 7 * width + 2 * width  # stem conv + BN
    c_in = width
    for stage, n in enumerate(blocks):
        p = width * 2**stage
        for b in range(n):
            total += c_in * p + 2 * p + 9 * p * p + 2 * p + p * 4 * p + 2 * 4 * p
            if b == 0:  # every stage's first block changes channels (or stride): projection + BN
                total += c_in * 4 * p + 2 * 4 * p
            c_in = 4 * p
    return total + c_in * classes + classes


def test_resnet_param_counts() -> None:
    assert resnet_params((3, 4, 6, 3), 64, 1000) == 25_557_032
    assert count(builder("resnet:resnet50")()) == 25_557_032
    assert (
        count(builder("resnet:resnet101")()) == resnet_params((3, 4, 23, 3), 64, 1000) == 44_549_160
    )
    assert (
        count(builder("resnet:resnet152")()) == resnet_params((3, 8, 36, 3), 64, 1000) == 60_192_808
    )
    assert count(builder("resnet:resnet200")()) == resnet_params((3, 24, 36, 3), 64, 1000)
    assert count(builder("resnet:resnet50")(width=8, num_classes=10)) == resnet_params(
        (3, 4, 6, 3), 8, 10
    )


def preact_params(n: int, width: int, classes: int) -> int:
    total = 3 * 9 * width
    c_in = width
    for stage in range(3):
        p = width * 2**stage
        for b in range(n):
            total += 2 * c_in + c_in * p + 2 * p + 9 * p * p + 2 * p + p * 4 * p
            if b == 0:
                total += c_in * 4 * p  # bias-free projection, no BN
            c_in = 4 * p
    return total + 2 * c_in + c_in * classes + classes


def test_preact_resnet_param_counts() -> None:
    assert count(builder("resnet:resnet1001")()) == preact_params(111, 16, 10) == 10_327_706
    assert count(builder("resnet:preact_resnet")(29)) == preact_params(3, 16, 10)


def test_vgg16_param_count() -> None:
    layout = [64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512]
    convs = sum(
        9 * c_in * c_out + c_out for c_in, c_out in zip([3] + layout[:-1], layout, strict=True)
    )
    fcs = 512 * 7 * 7 * 4096 + 4096 + 4096 * 4096 + 4096 + 4096 * 1000 + 1000
    assert convs + fcs == 138_357_544
    assert count(builder("vgg:vgg16")()) == 138_357_544
    assert count(builder("vgg:vgg16")(batch_norm=True)) == 138_357_544 + 2 * sum(layout)


def wrn_params(depth: int, k: int, classes: int) -> int:
    n = (depth - 4) // 6
    total, c_in = 3 * 9 * 16, 16
    for stage in range(3):
        c = 16 * k * 2**stage
        for _ in range(n):
            total += 2 * c_in + 9 * c_in * c + 2 * c + 9 * c * c + (c_in * c if c_in != c else 0)
            c_in = c
    return total + 2 * c_in + c_in * classes + classes


def test_wrn_param_counts() -> None:
    assert wrn_params(28, 10, 10) == 36_479_194
    assert count(builder("wrn:wrn_28_10")()) == 36_479_194
    assert count(builder("wrn:wrn")(40, 4, num_classes=100)) == wrn_params(40, 4, 100)


def gpt_params(h: int, layers: int, seq: int, vocab: int, tied: bool = True) -> int:
    per_layer = 12 * h * h + 13 * h  # LN 2h, qkv 3h^2+3h, proj h^2+h, LN 2h, fc 4h^2+4h, fc 4h^2+h
    return vocab * h + seq * h + layers * per_layer + 2 * h + (0 if tied else vocab * h)


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("gpt_tiny", (64, 2, 32, 512)),
        ("gpt2_small", (768, 12, 1024, 50257)),
        ("gpt2_medium", (1024, 24, 1024, 50257)),
        ("megatron_1_2b", (1536, 40, 1024, 50257)),
        ("megatron_2_5b", (1920, 54, 1024, 50257)),
        ("megatron_8_3b", (3072, 72, 1024, 50257)),
        ("gpt_50b", (8192, 62, 1024, 50257)),
    ],
)
def test_gpt_param_counts(name: str, config: tuple[int, int, int, int]) -> None:
    assert count(builder(f"gpt:{name}")()) == gpt_params(*config)


def test_gpt_50b_is_50b() -> None:
    n = count(builder("gpt:gpt_50b")())
    assert (
        n
        == 8192 * 50257 + 1024 * 8192 + 62 * (12 * 8192**2 + 13 * 8192) + 2 * 8192
        == 50_355_707_904
    )
    assert abs(n - 50e9) / 50e9 < 0.02


def test_gpt_tied_and_untied_heads() -> None:
    kwargs = {"hidden": 64, "layers": 2, "heads": 4, "seq_len": 32, "vocab": 512}
    tied = builder("gpt:gpt")(**kwargs)
    untied = builder("gpt:gpt")(tie_embeddings=False, **kwargs)
    assert count(tied) == gpt_params(64, 2, 32, 512)
    assert count(untied) == gpt_params(64, 2, 32, 512, tied=False)
    graph = torch.fx.symbolic_trace(tied).graph
    assert any(n.op == "get_attr" and n.target == "wte.weight" for n in graph.nodes)


def bert_params(h: int, layers: int, seq: int, vocab: int, types: int = 2) -> int:
    embeddings = (vocab + seq + types) * h + 2 * h
    mlm_head = h * h + h + 2 * h + vocab  # dense, LN, decoder bias (decoder weight tied)
    return embeddings + layers * (12 * h * h + 13 * h) + mlm_head


def test_bert_param_counts() -> None:
    assert bert_params(1024, 24, 512, 30522) == 335_174_458
    assert count(builder("bert:bert_large")()) == 335_174_458
    assert count(builder("bert:bert_base")()) == bert_params(768, 12, 512, 30522) == 109_514_298
    assert count(builder("bert:bert_tiny")()) == bert_params(64, 2, 32, 512)


def test_unet_param_count() -> None:
    def double(c_in: int, c: int) -> int:
        return 9 * c_in * c + 2 * c + 9 * c * c + 2 * c

    widths = [64, 128, 256, 512, 1024]
    total = sum(
        double(c_in, c) for c_in, c in zip([3] + widths[:3], widths[:4], strict=True)
    ) + double(512, 1024)
    total += sum(4 * 2 * c * c + c + double(2 * c, c) for c in widths[:4])  # up-conv + decoder
    total += 64 * 2 + 2
    assert count(builder("unet:unet")()) == total == 31_037_698


def test_amoebanet_structure() -> None:
    model = builder("amoebanet:amoebanet_d")(num_layers=6, num_filters=32, num_classes=7)
    cells = model.get_submodule("cells")
    assert isinstance(cells, nn.ModuleList)
    assert len(cells) == 6 + 4  # 2 stem reductions + 6 normal + 2 reductions
    last = dict(model.named_modules())["fc"]
    assert (
        isinstance(last, nn.Linear) and last.in_features == 4 * (4 * 32) and last.out_features == 7
    )


# ---------------------------------------------------------------------------------------------
# Argument validation.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "kwargs", "words"),
    [
        ("resnet:resnet", {"depth": 34}, ("34", "50", "101", "152", "200")),
        ("resnet:preact_resnet", {"depth": 100}, ("100",)),
        ("wrn:wrn", {"depth": 27}, ("27",)),
        ("amoebanet:amoebanet_d", {"num_layers": 4}, ("4",)),
        ("gpt:gpt", {"hidden": 100, "layers": 1, "heads": 3, "seq_len": 8}, ("100", "3")),
        ("bert:bert", {"hidden": 100, "layers": 1, "heads": 3}, ("100", "3")),
        ("unet:unet", {"depth": 0}, ("depth",)),
    ],
)
def test_invalid_arguments(spec: str, kwargs: dict[str, Any], words: tuple[str, ...]) -> None:
    with pytest.raises(ValueError) as info:
        builder(spec)(**kwargs)
    for word in words:
        assert word in str(info.value)


# ---------------------------------------------------------------------------------------------
# Tiny real forward passes on CPU, and traced == eager.
# ---------------------------------------------------------------------------------------------


def image(n: int, size: int, channels: int = 3) -> torch.Tensor:
    return torch.randn(n, channels, size, size)


def tokens(n: int, seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n, seq))


CPU_CASES: list[tuple[str, dict[str, Any], Callable[[], torch.Tensor], tuple[int, ...]]] = [
    ("resnet:resnet50", {"width": 8, "num_classes": 10}, lambda: image(2, 32), (2, 10)),
    ("resnet:preact_resnet", {"depth": 29}, lambda: image(2, 32), (2, 10)),
    ("vgg:vgg16", {"num_classes": 10}, lambda: image(1, 32), (1, 10)),
    ("wrn:wrn", {"depth": 10, "widen_factor": 1, "dropout": 0.2}, lambda: image(2, 32), (2, 10)),
    (
        "amoebanet:amoebanet_d",
        {"num_layers": 3, "num_filters": 16, "num_classes": 10},
        lambda: image(2, 64),
        (2, 10),
    ),
    (
        "amoebanet:amoebanet_d",
        {"num_layers": 3, "num_filters": 8, "num_classes": 5},
        lambda: image(2, 45),
        (2, 5),
    ),
    ("gpt:gpt_tiny", {}, lambda: tokens(2, 32, 512), (2, 32, 512)),
    ("gpt:gpt_tiny", {}, lambda: tokens(3, 17, 512), (3, 17, 512)),
    ("bert:bert_tiny", {}, lambda: tokens(2, 32, 512), (2, 32, 512)),
    ("unet:unet_small", {}, lambda: image(2, 64), (2, 2, 64, 64)),
    (
        "unet:unet_small",
        {"in_channels": 1, "num_classes": 4},
        lambda: image(1, 40, 1),
        (1, 4, 40, 40),
    ),
]


@pytest.mark.parametrize(("spec", "kwargs", "make_input", "shape"), CPU_CASES)
def test_cpu_forward_and_trace(
    spec: str,
    kwargs: dict[str, Any],
    make_input: Callable[[], torch.Tensor],
    shape: tuple[int, ...],
) -> None:
    torch.manual_seed(0)
    model = builder(spec)(device="cpu", **kwargs)
    assert model.training and all(p.device.type == "cpu" for p in model.parameters())
    x = make_input()
    out = model(x)  # train mode: dropout and batch statistics
    assert out.shape == shape and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    model.eval()
    traced = torch.fx.symbolic_trace(model)
    with torch.no_grad():
        assert torch.equal(traced(x), model(x))


@pytest.mark.parametrize(
    ("spec", "kwargs", "make_input"),
    [
        ("resnet:resnet50", {"width": 8, "num_classes": 10}, lambda: image(2, 32)),
        ("amoebanet:amoebanet_d", {"num_layers": 3, "num_filters": 8}, lambda: image(2, 32)),
        ("gpt:gpt_tiny", {}, lambda: tokens(2, 32, 512)),
        ("bert:bert_tiny", {}, lambda: tokens(2, 32, 512)),
    ],
)
def test_backward_reaches_every_parameter(
    spec: str, kwargs: dict[str, Any], make_input: Callable[[], torch.Tensor]
) -> None:
    torch.manual_seed(0)
    model = builder(spec)(device="cpu", **kwargs)
    model(make_input()).square().mean().backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert not missing


def test_cpu_build_is_deterministic() -> None:
    states = []
    for _ in range(2):
        torch.manual_seed(0)
        states.append(
            builder("resnet:resnet50")(width=8, num_classes=10, device="cpu").state_dict()
        )
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    torch.manual_seed(0)
    a = builder("gpt:gpt_tiny")(device="cpu").state_dict()
    torch.manual_seed(0)
    b = builder("gpt:gpt_tiny")(device="cpu").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------
# Full-size shapes on meta (no compute).
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "x", "shape"),
    [
        ("resnet:resnet1001", torch.empty(1, 3, 1024, 1024, device="meta"), (1, 10)),
        ("resnet:resnet50", torch.empty(2, 3, 224, 224, device="meta"), (2, 1000)),
        ("amoebanet:amoebanet_d", torch.empty(2, 3, 224, 224, device="meta"), (2, 1000)),
        ("wrn:wrn_28_10", torch.empty(2, 3, 32, 32, device="meta"), (2, 10)),
        ("gpt:gpt_50b", torch.zeros(1, 1024, dtype=torch.long, device="meta"), (1, 1024, 50257)),
        ("bert:bert_large", torch.zeros(2, 512, dtype=torch.long, device="meta"), (2, 512, 30522)),
        ("unet:unet", torch.empty(1, 3, 1024, 1024, device="meta"), (1, 2, 1024, 1024)),
    ],
)
def test_meta_forward_shapes(spec: str, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    assert builder(spec)()(x).shape == shape


def test_amoebanet_d_18_208_matches_the_gpipe_size() -> None:
    # GPipe (Huang et al. 2019), Table 1: AmoebaNet-D (18, 208) has 82M parameters.
    model = builder("amoebanet:amoebanet_d")(num_layers=18, num_filters=208)
    assert count(model) == pytest.approx(82e6, rel=0.10)
