"""Models built from a configuration class (Hugging Face ``transformers``): ``transformers:GPT2LMHeadModel``.

A model spec may name a class whose ``config_class`` takes the builder arguments (as every
``transformers`` model class does): the model is ``cls(cls.config_class(**arguments))``, built from
the configuration alone, so no weights are downloaded. Training needs no key/value cache, so
``use_cache`` is off unless the arguments say otherwise (a cache object is not a tensor and cannot
be captured as a graph output). An argument the configuration does not know is an error: the
configuration classes would otherwise keep a misspelt name as an unused attribute.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import Any

from cost_models.errors import ModelSpecError

_TRAINING_DEFAULTS = {"use_cache": False}


def is_config_model(builder: Any) -> bool:
    """Whether ``builder`` is a model class built from a ``config_class`` (a transformers model)."""
    return inspect.isclass(builder) and inspect.isclass(getattr(builder, "config_class", None))


def build_from_config(model_class: type, kwargs: Mapping[str, Any]) -> Any:
    """``model_class(config)`` with the configuration made from ``kwargs`` (see the module docstring)."""
    config_class = model_class.config_class
    default = config_class()
    known = set(default.to_dict()) | set(getattr(config_class, "attribute_map", {}))
    unknown = sorted(name for name in kwargs if name not in known and not hasattr(default, name))
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
        hint = f"did you mean {close[0]!r}?" if close else "give a field of the configuration"
        raise ModelSpecError(f"{config_class.__name__} has no field {unknown[0]!r} (an argument of "
                             f"{model_class.__name__}); {hint} The fields are the keys of "
                             f"{config_class.__name__}().to_dict()")
    return model_class(config_class(**{**_TRAINING_DEFAULTS, **kwargs}))
