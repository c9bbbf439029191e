"""DeviceSpec and LinkSpec: what the cost models know about an accelerator and its links."""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cost_models.errors import InvalidArgument

MATH_FORMATS: tuple[str, ...] = ("fp64", "fp32", "tf32", "fp16", "bf16")
BACKENDS: tuple[str, ...] = ("nccl", "gloo")  # GPUs talk through NCCL; CPU ranks through gloo, on their own cores
"""Number formats a device has a peak FLOP/s for (`DeviceSpec.peak_flops`), in the order of the
`*_tflops` fields. Training precisions (cost_models.memory.Precision) pick one of them."""

BYTES_PER_GB = 1e9  # bandwidths use decimal GB (1e9 bytes), as datasheets and PCI-SIG do
CALIBRATED = " (calibrated)"  # what `tessera calibrate` adds to the name of the preset it measured


def _check_number(owner: str, field: str, value: object, *, allow_zero: bool) -> float:
    """Return `value` as a finite float, or raise InvalidArgument naming `owner.field` and the value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(
            f"{owner}: field {field!r} must be a number, got {value!r} ({type(value).__name__}); pass an int or float"
        )
    number = float(value)
    bound_ok = number >= 0.0 if allow_zero else number > 0.0
    if not math.isfinite(number) or not bound_ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise InvalidArgument(f"{owner}: field {field!r} must be finite and {bound}, got {value!r}")
    return number


def require_count(value: object, what: str, *, minimum: int) -> int:
    """Return `value` as an int >= `minimum`, or raise InvalidArgument naming `what` and the value."""
    if isinstance(value, bool):
        raise InvalidArgument(f"{what} must be an int, got {value!r}")
    try:
        count = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument(
            f"{what} must be an int, got {value!r} ({type(value).__name__}); round it with int() first"
        ) from None
    if count < minimum:
        raise InvalidArgument(f"{what} must be >= {minimum}, got {count}")
    return count


@dataclass(frozen=True)
class LinkSpec:
    """One data path of a GPU, modelled alpha-beta: a fixed latency plus bytes over a bandwidth.

    `bandwidth_gb_per_s` is per direction and per GPU, with GB = 1e9 bytes. `post_us` is what posting
    one message (one tensor's send or receive) costs the rank that posts it: time its compute waits.
    It is 0 where the host queues the message ahead of a GPU's work (NCCL) and measured where the
    rank's own core posts it (gloo on a CPU rank: cost_models.cpu_device).
    """

    name: str
    bandwidth_gb_per_s: float
    latency_us: float
    post_us: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidArgument(f"LinkSpec: field 'name' must be a non-empty string, got {self.name!r}")
        owner = f"LinkSpec {self.name!r}"
        bandwidth = _check_number(owner, "bandwidth_gb_per_s", self.bandwidth_gb_per_s, allow_zero=False)
        latency = _check_number(owner, "latency_us", self.latency_us, allow_zero=True)
        post = _check_number(owner, "post_us", self.post_us, allow_zero=True)
        object.__setattr__(self, "bandwidth_gb_per_s", bandwidth)
        object.__setattr__(self, "latency_us", latency)
        object.__setattr__(self, "post_us", post)

    def bandwidth_bytes_per_s(self) -> float:
        """Per-direction bandwidth in bytes per second."""
        return self.bandwidth_gb_per_s * BYTES_PER_GB

    def transfer_ms(self, nbytes: int) -> float:
        """Milliseconds to move `nbytes` one way: latency + nbytes / bandwidth; 0.0 for 0 bytes."""
        count = require_count(nbytes, "nbytes", minimum=0)
        if count == 0:
            return 0.0
        return self.latency_us * 1e-3 + count / self.bandwidth_bytes_per_s() * 1e3

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form: {"name", "bandwidth_gb_per_s", "latency_us", "post_us"}."""
        return {"name": self.name, "bandwidth_gb_per_s": self.bandwidth_gb_per_s, "latency_us": self.latency_us,
                "post_us": self.post_us}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "link") -> LinkSpec:
        """Inverse of `to_dict`; `where` names the object in error messages (e.g. "intra_node"). A file
        written before ``post_us`` was recorded reads as 0 for it."""
        _check_keys(data, LINK_KEYS, where, optional=frozenset({"post_us"}))
        return cls(
            name=_expect_str(data["name"], f"{where}.name"),
            bandwidth_gb_per_s=_expect_float(data["bandwidth_gb_per_s"], f"{where}.bandwidth_gb_per_s"),
            latency_us=_expect_float(data["latency_us"], f"{where}.latency_us"),
            post_us=_expect_float(data.get("post_us", 0.0), f"{where}.post_us"),
        )


@dataclass(frozen=True)
class OptimizerStepCost:
    """An optimizer step measured on a device: a fixed time per parameter tensor (torch's per-tensor Python
    and op launches) and a time per parameter (the passes its ops make over the parameter's state)."""

    us_per_tensor: float
    ns_per_param: float

    def ms(self, tensors: float, params: float) -> float:
        return tensors * self.us_per_tensor / 1e3 + params * self.ns_per_param / 1e6

    def params_per_s(self, sizes: Sequence[int]) -> float:
        """Parameters per second over one step of tensors of ``sizes`` parameters (the per-tensor time spread
        over them).

        >>> round(OptimizerStepCost(us_per_tensor=10.0, ns_per_param=1.0).params_per_s([10_000, 10_000]))
        500000000
        """
        return sum(sizes) / max(self.ms(len(sizes), sum(sizes)) / 1e3, 1e-12)


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or the host CPU) as the cost models see it.

    `mem_bytes` is the nominal memory capacity in bytes. For GPU presets it is the datasheet
    capacity read as GiB (HBM is sized in powers of two: "16 GB" = 16 * 2**30 bytes); the CUDA
    context and driver reservations are NOT subtracted here.

    Each `*_tflops` is the dense (no structured sparsity) peak for matmul in that precision, in
    TFLOP/s: on tensor cores where the device has them for that precision, else on the regular
    FP units; 0.0 means the device cannot run that precision (V100 has no tf32/bf16 tensor cores).

    `matmul_efficiency`, `memory_efficiency` and `kernel_overhead_us` are calibration values, not
    datasheet figures: the achieved fraction of peak FLOP/s for dense matmul/conv, the achieved
    fraction of peak memory bandwidth for elementwise kernels, and the fixed cost per launched op.

    The host side is given per GPU, as its share of the node it sits in (the node's host memory,
    NVMe capacity and optimizer throughput divided by the node's GPUs), so a node of any size is
    ``gpus_per_node`` times it: `host_mem_bytes`, `nvme_bytes`, and `host_optimizer_params_per_s`
    (parameters per second an optimizer step on the host's cores updates; a calibration value), and
    `host_grad_sum_params_per_s` (parameters per second the host adds a gradient into its sum, as ZeRO-Offload's
    gradients arrive each backward; measured by ``tessera calibrate --device cuda``, else None:
    :meth:`grad_sum_params_per_s` estimates it).
    Older device files without them get the defaults below.

    `optimizer_steps` gives, per optimizer name, what a step of torch's optimizer measured on the device
    costs (:class:`OptimizerStepCost`: per parameter tensor and per parameter), where measured (the
    ``cpu`` device); without it a step is costed from the bytes it reads and writes at the memory
    bandwidth (presets: torch's multi-tensor kernels on CUDA launch once for many tensors).

    `backend` is what the runtime's ranks on it communicate with: ``nccl`` (GPUs) or ``gloo`` (CPU ranks,
    whose messages and all-reduces are copied and summed by their own cores; cost_models/comm.py).
    """

    name: str
    mem_bytes: int
    fp64_tflops: float
    fp32_tflops: float
    tf32_tflops: float
    fp16_tflops: float
    bf16_tflops: float
    mem_bandwidth_gb_per_s: float
    intra_node: LinkSpec
    inter_node: LinkSpec
    host_link: LinkSpec
    nvme: LinkSpec
    matmul_efficiency: float
    memory_efficiency: float
    kernel_overhead_us: float
    host_mem_bytes: int = 64 * 2**30
    nvme_bytes: int = 1_000_000_000_000
    host_optimizer_params_per_s: float = 4e8
    host_grad_sum_params_per_s: float | None = None  # where measured (a GPU's calibration)
    collective_link: LinkSpec | None = None  # how an all-reduce within a node runs, where measured (else intra_node)
    optimizer_steps: tuple[tuple[str, OptimizerStepCost], ...] = ()  # (optimizer name, its measured step)
    backend: str = "nccl"  # what its ranks communicate with (BACKENDS)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidArgument(f"DeviceSpec: field 'name' must be a non-empty string, got {self.name!r}")
        owner = f"DeviceSpec {self.name!r}"
        if self.backend not in BACKENDS:
            raise InvalidArgument(f"{owner}: field 'backend' must be one of {', '.join(BACKENDS)}, "
                                  f"got {self.backend!r}")
        if isinstance(self.mem_bytes, bool) or not isinstance(self.mem_bytes, int) or self.mem_bytes <= 0:
            raise InvalidArgument(
                f"{owner}: field 'mem_bytes' must be a positive int number of bytes, got {self.mem_bytes!r}"
            )
        for field in ("fp64_tflops", "tf32_tflops", "fp16_tflops", "bf16_tflops"):
            object.__setattr__(self, field, _check_number(owner, field, getattr(self, field), allow_zero=True))
        for field in ("fp32_tflops", "mem_bandwidth_gb_per_s"):
            object.__setattr__(self, field, _check_number(owner, field, getattr(self, field), allow_zero=False))
        for field in ("matmul_efficiency", "memory_efficiency"):
            value = _check_number(owner, field, getattr(self, field), allow_zero=False)
            if value > 1.0:
                raise InvalidArgument(
                    f"{owner}: field {field!r} is a fraction of peak and must be in (0, 1], got {value!r}"
                )
            object.__setattr__(self, field, value)
        overhead = _check_number(owner, "kernel_overhead_us", self.kernel_overhead_us, allow_zero=True)
        object.__setattr__(self, "kernel_overhead_us", overhead)
        for field in ("host_mem_bytes", "nvme_bytes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(f"{owner}: field {field!r} must be a non-negative int number of bytes, "
                                      f"got {value!r}")
        rate = _check_number(owner, "host_optimizer_params_per_s", self.host_optimizer_params_per_s,
                             allow_zero=False)
        object.__setattr__(self, "host_optimizer_params_per_s", rate)
        if self.host_grad_sum_params_per_s is not None:
            object.__setattr__(self, "host_grad_sum_params_per_s", _check_number(
                owner, "host_grad_sum_params_per_s", self.host_grad_sum_params_per_s, allow_zero=False))
        steps = self.optimizer_steps
        if isinstance(steps, Mapping):
            steps = tuple(sorted(steps.items()))
        if not isinstance(steps, tuple) or not all(isinstance(pair, tuple) and len(pair) == 2 and isinstance(
                pair[0], str) and isinstance(pair[1], OptimizerStepCost) for pair in steps):
            raise InvalidArgument(f"{owner}: field 'optimizer_steps' must map optimizer names to "
                                  f"OptimizerStepCost, got {self.optimizer_steps!r}")
        object.__setattr__(self, "optimizer_steps", steps)
        for field in LINK_FIELDS:
            link = getattr(self, field)
            if link is None and field == "collective_link":
                continue
            if not isinstance(link, LinkSpec):
                raise InvalidArgument(
                    f"{owner}: field {field!r} must be a LinkSpec, got {link!r} ({type(link).__name__})"
                )

    def grad_sum_params_per_s(self) -> float:
        """Parameters per second the host adds a gradient into its sum: the measured figure, else one estimated
        from the host's optimizer step by the arrays each touches (the sum reads two and writes one in the masters'
        dtype, Adam's step reads the gradient, the master and two moments and writes the last three: seven).

        Beside a GPU the estimate is cautious. On an H200's host (16 cores) Adam stepped 806 M parameters a
        second; a GPT's 341 M gradients sent down each micro-batch took 92-104 ms with their copies (25 ms on
        the link), so its sums ran at 4-5 G/s, not the 1.9 G/s estimated: the step was predicted 2.42 s and
        measured 1.51 s. On a CPU rank (the ``cpu`` device, not calibrated for it) the sums run inside the
        rank's own backward and the estimate holds: in a GPT stage's backward on one thread the adds took 0.5
        ns a parameter themselves and slowed the backward around them by 1.0-1.6 ns more (its caches), where
        the estimate and the copy it also costs come to 1.5 ns."""
        if self.host_grad_sum_params_per_s is not None:
            return self.host_grad_sum_params_per_s
        return self.host_optimizer_params_per_s * _ADAM_ARRAYS / _SUM_ARRAYS

    def optimizer_step(self, optimizer: str) -> OptimizerStepCost | None:
        """The measured step of ``optimizer`` (its plan name) on this device, or None where not measured."""
        return dict(self.optimizer_steps).get(optimizer)

    def supported_precisions(self) -> tuple[str, ...]:
        """The precisions with a non-zero peak on this device, in `MATH_FORMATS` order."""
        return tuple(p for p in MATH_FORMATS if getattr(self, f"{p}_tflops") > 0.0)

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s in `precision` (one of MATH_FORMATS)."""
        key = precision.lower() if isinstance(precision, str) else precision
        if key not in MATH_FORMATS:
            raise InvalidArgument(f"unknown precision {precision!r}; use one of {', '.join(MATH_FORMATS)}")
        tflops: float = getattr(self, f"{key}_tflops")
        if tflops <= 0.0:
            raise InvalidArgument(
                f"device {self.name!r} has no {key} support ({key}_tflops = 0); "
                f"it supports {', '.join(self.supported_precisions())}"
            )
        return tflops * 1e12

    def mem_bandwidth_bytes_per_s(self) -> float:
        """Peak memory bandwidth in bytes per second."""
        return self.mem_bandwidth_gb_per_s * BYTES_PER_GB

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (links as nested objects); `from_dict` inverts it exactly."""
        data: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in ("collective_link", "host_grad_sum_params_per_s") and value is None:
                continue  # not measured: all-reduces run as intra_node, sums at the estimated rate
            if field.name == "optimizer_steps":
                value = {name: dataclasses.asdict(cost) for name, cost in value}
            data[field.name] = value.to_dict() if isinstance(value, LinkSpec) else value
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceSpec:
        """Build a DeviceSpec from `to_dict` output; every key is required (but the host-side ones, which
        older files lack) and no other key is allowed."""
        _check_keys(data, DEVICE_KEYS, "device", optional=HOST_KEYS)
        kwargs: dict[str, Any] = {}
        for key in DEVICE_KEYS:
            if key not in data:
                continue
            value = data[key]
            if key in ("name", "backend"):
                kwargs[key] = _expect_str(value, key)
            elif key in ("mem_bytes", "host_mem_bytes", "nvme_bytes"):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise InvalidArgument(
                        f"key {key!r} must be an int number of bytes, got {value!r} ({type(value).__name__})"
                    )
                kwargs[key] = value
            elif key in LINK_FIELDS:
                if not isinstance(value, Mapping):
                    raise InvalidArgument(
                        f"key {key!r} must be an object with keys {', '.join(LINK_KEYS)}, "
                        f"got {value!r} ({type(value).__name__})"
                    )
                kwargs[key] = LinkSpec.from_dict(value, where=key)
            elif key == "optimizer_steps":
                if not isinstance(value, Mapping) or not all(isinstance(v, Mapping) for v in value.values()):
                    raise InvalidArgument(f"key {key!r} must map optimizer names to objects with keys "
                                          f"{', '.join(STEP_KEYS)}, got {value!r}")
                for name, cost in value.items():
                    _check_keys(cost, STEP_KEYS, f"{key}.{name}")
                kwargs[key] = {str(name): OptimizerStepCost(*(_expect_float(cost[k], f"{key}.{name}.{k}")
                                                              for k in STEP_KEYS)) for name, cost in value.items()}
            else:
                kwargs[key] = _expect_float(value, key)
        return cls(**kwargs)


LINK_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(LinkSpec))
STEP_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(OptimizerStepCost))
DEVICE_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(DeviceSpec))
LINK_FIELDS: tuple[str, ...] = ("intra_node", "inter_node", "host_link", "nvme", "collective_link")
_SUM_ARRAYS, _ADAM_ARRAYS = 3, 7  # arrays a gradient's sum and an Adam step read or write, per parameter
HOST_KEYS: frozenset[str] = frozenset({"host_mem_bytes", "nvme_bytes", "host_optimizer_params_per_s",
                                       "host_grad_sum_params_per_s",
                                       "collective_link", "optimizer_steps", "backend"})


def _check_keys(data: Mapping[str, Any], expected: tuple[str, ...], where: str,
                optional: frozenset[str] = frozenset()) -> None:
    if not isinstance(data, Mapping):
        raise InvalidArgument(
            f"{where} must be a JSON object with keys {', '.join(expected)}, got {type(data).__name__}"
        )
    missing = [k for k in expected if k not in data and k not in optional]
    unknown = sorted(str(k) for k in data if k not in expected)
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing key(s) {', '.join(repr(k) for k in missing)}")
        if unknown:
            parts.append(f"unknown key(s) {', '.join(repr(k) for k in unknown)}")
        raise InvalidArgument(f"{where}: {'; '.join(parts)}; expected exactly the keys {', '.join(expected)}")


def _expect_str(value: object, key: str) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"key {key!r} must be a string, got {value!r} ({type(value).__name__})")
    return value


def _expect_float(value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"key {key!r} must be a number, got {value!r} ({type(value).__name__})")
    return float(value)

