"""Device lookup: the catalog of presets plus the measured CPU, names, and device JSON files."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType

from cost_models.cpu_device import CPU_NAME, measure_cpu_device, measure_gloo_links
from cost_models.device_spec import DEVICE_KEYS, LINK_FIELDS, LINK_KEYS, MATH_FORMATS, DeviceSpec, LinkSpec
from cost_models.errors import InvalidArgument, UnknownDevice
from cost_models.presets import A100_40GB, A100_80GB, H100_80GB, H200_141GB, PRESETS, V100_16GB, V100_32GB

__all__ = ["A100_40GB", "A100_80GB", "DEVICES", "H100_80GB", "H200_141GB", "MATH_FORMATS", "PRESETS",
           "V100_16GB", "V100_32GB", "DeviceCatalog", "DeviceSpec", "LinkSpec", "cache_root", "cached_cpu_device",
           "get_device",
           "load_device", "measure_cpu_device", "save_device"]

CACHE_ENV = "TESSERA_CACHE_DIR"
"""Where tessera caches what it measures on this machine: the CPU device (``devices``) and the node times
plan() profiles (``profiles``); default ~/.cache/tessera."""


def cache_root() -> Path:
    """$TESSERA_CACHE_DIR, or ~/.cache/tessera."""
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/tessera").expanduser()


def cached_cpu_device(cache_dir: str | os.PathLike[str] | None = None,
                      measure: Callable[[], DeviceSpec] | None = None) -> DeviceSpec:
    """This machine's measured CPU (its matmul, copy and op figures and the gloo link between its ranks),
    measured once and cached as a device JSON keyed by the machine, its cores, torch and the thread
    count, so the same command plans alike every time. ``cache_dir`` defaults to $TESSERA_CACHE_DIR or
    ~/.cache/tessera; delete the file to measure again.
    """
    import torch

    root = (Path(cache_dir).expanduser() if cache_dir else cache_root()) / "devices"
    # v5: optimizer steps timed on a mix of tensor sizes; v6: its backend (gloo); v7: the steps multi-tensor;
    # v8: the host tier's Adam rate, its own measured step's (the host is this CPU); v10: gloo's post cost;
    # v11: the post cost after compute, as the runtime posts; v12: the optimizer's step after compute too;
    # v13-v14: the all-reduce's bandwidth as the runtime sums a bucket (flattened, summed, copied back) after
    # compute, in processes keeping freed memory as the runtime's; its latency the messages'
    machine = f"v14|{platform.node()}|{platform.machine()}|{os.cpu_count()}|{torch.__version__}"
    path = root / f"cpu-{hashlib.sha256(machine.encode()).hexdigest()[:16]}.json"
    if path.exists():
        try:
            return load_device(path)
        except (InvalidArgument, UnknownDevice):
            pass  # unreadable: measured again and rewritten below
    spec = (measure or _measure_cpu)()
    root.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    save_device(spec, partial)
    partial.replace(path)  # atomic: a concurrent planner reads the old file or the new one
    return spec

def _measure_cpu() -> DeviceSpec:
    """The CPU as a runtime rank uses it: one intra-op thread, and gloo between two local processes."""
    link, collective = measure_gloo_links()
    return measure_cpu_device(threads=1, link=link, collective=collective)


class DeviceCatalog(Mapping[str, DeviceSpec]):
    """Read-only mapping of the GPU presets plus "cpu"; the CPU is measured on first access, once (and
    cached across processes: :func:`cached_cpu_device`)."""

    def __init__(
        self,
        presets: Mapping[str, DeviceSpec] = PRESETS,
        *,
        measure_cpu: Callable[[], DeviceSpec] = cached_cpu_device,
    ) -> None:
        if CPU_NAME in presets:
            raise InvalidArgument(f"preset name {CPU_NAME!r} is reserved for the measured CPU; rename the preset")
        self._presets: Mapping[str, DeviceSpec] = MappingProxyType(dict(presets))
        self._measure_cpu = measure_cpu
        self._cpu: DeviceSpec | None = None
        self._lock = threading.Lock()

    @property
    def cpu_measured(self) -> bool:
        """Whether the "cpu" entry has been measured yet."""
        return self._cpu is not None

    def __getitem__(self, name: str) -> DeviceSpec:
        if name == CPU_NAME:
            with self._lock:
                if self._cpu is None:
                    self._cpu = self._measure_cpu()
                return self._cpu
        return self._presets[name]

    def __iter__(self) -> Iterator[str]:
        yield from self._presets
        yield CPU_NAME

    def __len__(self) -> int:
        return len(self._presets) + 1

    def __contains__(self, name: object) -> bool:  # avoids measuring the CPU for a membership test
        try:
            return name == CPU_NAME or name in self._presets
        except TypeError:  # unhashable key
            return False

    def __repr__(self) -> str:
        cpu = "measured" if self.cpu_measured else "not measured yet"
        return f"DeviceCatalog(presets={list(self._presets)}, cpu={cpu})"


DEVICES = DeviceCatalog()
"""The process-wide catalog: the GPU presets plus the lazily measured "cpu"."""


# --------------------------------------------------------------------------------------------
# Lookup and JSON I/O.
# --------------------------------------------------------------------------------------------


def _normalise(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def _json_help() -> str:
    return (
        "a custom device can be given as a path to a JSON file holding one object with the keys "
        f"{', '.join(DEVICE_KEYS)} (each of {', '.join(LINK_FIELDS)} is an object with keys "
        f"{', '.join(LINK_KEYS)}); write one with save_device(spec, 'my_gpu.json') or "
        "json.dump(DeviceSpec.to_dict(), ...)"
    )


def get_device(spec: str | os.PathLike[str] | DeviceSpec) -> DeviceSpec:
    """Resolve a DeviceSpec, a preset or "cpu" name (case/punctuation-insensitive), or a device JSON path."""
    if isinstance(spec, DeviceSpec):
        return spec
    if isinstance(spec, os.PathLike):
        return load_device(spec)
    if not isinstance(spec, str):
        raise UnknownDevice(f"device must be a name, a JSON path or a DeviceSpec, got {spec!r} ({type(spec).__name__})")
    key = _normalise(spec)
    if key == CPU_NAME:
        return DEVICES[CPU_NAME]
    by_key = {_normalise(name): preset for name, preset in PRESETS.items()}
    if key and key in by_key:
        return by_key[key]
    # A bare model name ("H100") is accepted when exactly one preset carries it.
    same_model = [p for name, p in PRESETS.items() if key and _normalise(name.split("-")[0]) == key]
    if len(same_model) == 1:
        return same_model[0]
    if spec.lower().endswith(".json") or os.path.isfile(spec):
        return load_device(spec)
    hint = ""
    if len(same_model) > 1:
        hint = f"{spec!r} is ambiguous: say which of {', '.join(p.name for p in same_model)}; "
    raise UnknownDevice(
        f"unknown device {spec!r}: {hint}use one of the presets {', '.join(PRESETS)} or {CPU_NAME!r} "
        f"(case and '-'/'_' do not matter), or {_json_help()}"
    )


def load_device(path: str | os.PathLike[str]) -> DeviceSpec:
    """Read a DeviceSpec from a JSON file written by `save_device` (or by hand with the same keys)."""
    where = os.fspath(path)
    try:
        text = Path(where).read_text(encoding="utf-8")
    except OSError as exc:
        raise UnknownDevice(f"cannot read device file {where!r}: {exc.strerror or exc}; {_json_help()}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UnknownDevice(f"device file {where!r} is not valid JSON ({exc}); {_json_help()}") from exc
    if not isinstance(data, dict):
        raise UnknownDevice(
            f"device file {where!r} must hold one JSON object, got {type(data).__name__}; {_json_help()}"
        )
    try:
        return DeviceSpec.from_dict(data)
    except InvalidArgument as exc:
        raise UnknownDevice(f"device file {where!r}: {exc}") from exc


def save_device(spec: DeviceSpec, path: str | os.PathLike[str]) -> None:
    """Write `spec` as pretty-printed JSON that `load_device` reads back to an equal DeviceSpec."""
    if not isinstance(spec, DeviceSpec):
        raise InvalidArgument(f"save_device expects a DeviceSpec, got {spec!r} ({type(spec).__name__})")
    Path(path).write_text(json.dumps(spec.to_dict(), indent=2) + "\n", encoding="utf-8")
