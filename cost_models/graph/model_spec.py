"""Model specs ("pkg.mod:builder", "path/file.py:builder"), builder arguments and input shapes."""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cost_models.errors import InvalidArgument, ModelSpecError, TesseraWarning, describe_error

_DTYPES = {"float32": "float32", "float": "float32", "fp32": "float32", "float64": "float64",
           "double": "float64", "float16": "float16", "half": "float16", "bfloat16": "bfloat16",
           "int64": "int64", "long": "int64", "int32": "int32", "int": "int32", "bool": "bool"}
_INPUT_PATTERN = re.compile(r"^\d+(x\d+)*$")


@dataclass(frozen=True)
class InputSpec:
    """One model input without its batch dimension: ``3x224x224`` or ``1024:int64``."""

    shape: tuple[int, ...]
    dtype: str = "float32"

    def __str__(self) -> str:
        dims = "x".join(str(d) for d in self.shape)
        return dims if self.dtype == "float32" else f"{dims}:{self.dtype}"


def parse_input(text: str) -> InputSpec:
    """Parse ``3x224x224`` or ``1024:int64`` (shape per sample, batch dimension excluded)."""
    dims, _, dtype = text.strip().partition(":")
    dtype = dtype or "float32"
    if not _INPUT_PATTERN.match(dims):
        raise InvalidArgument(f"malformed input shape {text!r}: expected positive sizes separated "
                              f"by 'x' without the batch dimension, e.g. 3x224x224 or 1024:int64")
    shape = tuple(int(d) for d in dims.split("x"))
    if any(d <= 0 for d in shape):
        raise InvalidArgument(f"input shape {text!r} has a zero dimension; every size must be >= 1")
    if dtype.lower() not in _DTYPES:
        raise InvalidArgument(f"unknown dtype {dtype!r} in input {text!r}; use one of "
                              f"{', '.join(sorted(set(_DTYPES.values())))}")
    return InputSpec(shape, _DTYPES[dtype.lower()])


def parse_model_args(pairs: Sequence[str]) -> dict[str, Any]:
    """``["depth=50", "use_where=false", "name='x'"]`` → ``{"depth": 50, "use_where": False, "name": "x"}``.

    Each value is read by :func:`parse_model_value`; a malformed pair or value names the accepted forms.
    """
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip().isidentifier():
            raise InvalidArgument(f"malformed model argument {pair!r}: expected key=value, "
                                  f"e.g. --model-arg num_classes=10")
        kwargs[key.strip()] = parse_model_value(key.strip(), value.strip())
    return kwargs


_MODEL_ARG_FORMS = ("true/false", "none", "an integer (10, -3)", "a float (0.5, 1e-3)",
                    "a quoted string ('gelu' or \"gelu\")", "a plain word (gelu, resnet_v2)",
                    "a list of these ([3, 4, 6, 3])")
_KEYWORDS = {"true": True, "false": False, "none": None, "null": None}
_INTEGER = re.compile(r"^[+-]?\d+$")
_FLOAT = re.compile(r"^[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?$")
_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-/]*$")
_AMBIGUOUS_WORDS = frozenset({"yes", "no", "on", "off", "y", "n", "t", "f", "nan", "inf", "infinity"})


def parse_model_value(key: str, text: str) -> Any:
    """One builder argument's value: booleans, none, numbers, quoted strings, plain words, lists.

    Anything else (``yes``, ``16GB``, ``1e``, ``0x10``) is ambiguous and an error naming the forms.
    """
    if text.lower() in _KEYWORDS:
        return _KEYWORDS[text.lower()]
    if _INTEGER.match(text):
        return int(text)
    if _FLOAT.match(text):
        return float(text)
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text.startswith(("[", "(")) and text.endswith(("]", ")")):
        return _parse_list(key, text)
    if _WORD.match(text) and text.lower() not in _AMBIGUOUS_WORDS:
        return text
    raise InvalidArgument(f"model argument {key}={text!r} is ambiguous: write {', '.join(_MODEL_ARG_FORMS)}; "
                          f"quote a string that looks like something else, e.g. {key}='{text}'")


def _parse_list(key: str, text: str) -> list[Any]:
    inner = text[1:-1].strip()
    return [parse_model_value(key, item.strip()) for item in inner.split(",")] if inner else []


def load_builder(spec: str, search_root: Path | None = None) -> Callable[..., Any]:
    """Resolve ``pkg.mod:builder`` or ``path/file.py:builder`` to the builder function (or model class)."""
    location, sep, name = spec.rpartition(":")
    if not sep or not location or not name.isidentifier():
        raise ModelSpecError(f"malformed model spec {spec!r}: expected 'pkg.module:builder' or "
                             f"'path/to/file.py:builder', e.g. examples/models/resnet.py:resnet50")
    module = _load_file(location, search_root) if location.endswith(".py") else _import(location)
    builder = getattr(module, name, None)
    if not callable(builder):
        available = sorted(n for n, v in vars(module).items()
                           if inspect.isfunction(v) and not n.startswith("_") and v.__module__ == module.__name__)
        close = difflib.get_close_matches(name, [n for n in dir(module) if not n.startswith("_")], n=3)
        defines = ", ".join(available) or ("none (give a model class with a config_class, e.g. "
                                           "transformers:GPT2LMHeadModel)")
        raise ModelSpecError(f"{location} has no builder function {name!r}; it defines {defines}"
                             + (f"; did you mean {', '.join(close)}?" if close else ""))
    return builder


def builder_forms(spec: str, search_root: Path) -> tuple[str, str | None]:
    """``path/file.py:builder`` → (its absolute form, the relative form as given); others → (spec, None).

    A plan stores both: the absolute one resolves from any directory, the relative one from a copy
    of the project elsewhere (see :func:`resolve_builder`).
    """
    location, sep, name = spec.rpartition(":")
    if not sep or not location.endswith(".py") or Path(location).is_absolute():
        return spec, None
    return f"{(search_root / location).resolve()}:{name}", spec


def resolve_builder(specs: Sequence[str], search_root: Path | None = None) -> tuple[Callable[..., Any], str]:
    """The builder of the first spec whose model file exists (module specs always count), and that spec.

    Falling back past a missing file is a TesseraWarning naming the file and the spec used.
    """
    missing = [spec for spec in specs if not _file_exists(spec, search_root)]
    usable = [spec for spec in specs if spec not in missing]
    if not usable:
        return load_builder(specs[0], search_root), specs[0]  # raises, naming the first file
    if missing and missing[0] == specs[0]:
        warnings.warn(TesseraWarning(f"model file of {specs[0]!r} does not exist; using {usable[0]!r} "
                                     f"(from {search_root or Path.cwd()})"), stacklevel=2)
    return load_builder(usable[0], search_root), usable[0]


def _file_exists(spec: str, search_root: Path | None) -> bool:
    location = spec.rpartition(":")[0]
    if not location.endswith(".py"):
        return True
    path = Path(location)
    return (path if path.is_absolute() or search_root is None else search_root / path).is_file()


def build_model(builder: Callable[..., Any], kwargs: Mapping[str, Any], device: str) -> Any:
    """Call ``builder(**kwargs)`` on ``device`` (passed as ``device=`` when the builder takes it).

    A model class with a ``config_class`` (``transformers:GPT2LMHeadModel``) is built from the
    configuration ``kwargs`` make (cost_models/graph/config_models.py).
    """
    import torch

    from cost_models.graph.config_models import build_from_config, is_config_model

    if is_config_model(builder):
        try:
            with torch.device(device):
                return build_from_config(builder, kwargs)
        except ModelSpecError:
            raise
        except Exception as error:  # the model's own check of its configuration (a user's value): one line
            raise ModelSpecError(f"{builder.__name__}({_describe(kwargs)}) failed: "
                                 f"{describe_error(error)}; change the --model-arg values") from error
    parameters = inspect.signature(builder).parameters
    takes_device = "device" in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    call_kwargs = {**kwargs, "device": device} if takes_device else dict(kwargs)
    try:
        with torch.device(device):
            model = builder(**call_kwargs)
    except TypeError as error:
        raise ModelSpecError(f"{builder.__name__}({_describe(kwargs)}) failed: {error}; valid "
                             f"arguments: {', '.join(parameters) or 'none'}") from error
    except Exception as error:  # the builder's own failure: named in one line, its traceback kept as the cause
        raise ModelSpecError(f"{builder.__name__}({_describe(kwargs)}) failed: "
                             f"{describe_error(error)}; fix the builder or its --model-arg values") from error
    if not isinstance(model, torch.nn.Module):
        raise ModelSpecError(f"{builder.__name__} returned {type(model).__name__}, not an nn.Module")
    return model


def _describe(kwargs: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def _import(module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        raise ModelSpecError(f"cannot import {module_name!r} ({error}); give a module importable "
                             f"from the current directory or a file path like "
                             f"examples/models/resnet.py:resnet50") from error


def _load_file(location: str, search_root: Path | None) -> Any:
    path = Path(location)
    if not path.is_absolute() and search_root is not None:
        path = search_root / path
    if not path.is_file():
        raise ModelSpecError(f"model file {location!r} does not exist (looked at {path.resolve()})")
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    module_spec = importlib.util.spec_from_file_location(f"tessera_model_{digest}", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - a user file may raise anything while importing
        raise ModelSpecError(f"importing {location} failed: {type(error).__name__}: {error}") from error
    return module


def example_inputs(specs: Sequence[InputSpec], batch_size: int, device: str) -> tuple[Any, ...]:
    """Tensors for ``specs`` with ``batch_size`` first: empty on meta, random elsewhere."""
    import torch

    tensors = []
    for spec in specs:
        dtype = getattr(torch, spec.dtype)
        shape = (batch_size, *spec.shape)
        if device == "meta":
            tensors.append(torch.empty(shape, dtype=dtype, device="meta"))
        elif dtype.is_floating_point:
            tensors.append(torch.randn(shape, dtype=dtype, device=device))
        else:
            tensors.append(torch.randint(0, 2, shape, dtype=dtype, device=device))
    return tuple(tensors)
