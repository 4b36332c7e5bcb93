"""A model folder's ``generation_config.json`` as the sampling defaults of its requests.

As vLLM's ``--generation-config auto``: a sampling field a request leaves out takes the value the
model's generation config gives it (Qwen's releases ship ``temperature``, ``top_p``, ``top_k``), for
every family; a field the request sets wins. The fields read are the sampling fields Metrale serves
under their Hugging Face names (``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty``) and the two OpenAI penalties some folders add (``presence_penalty``,
``frequency_penalty``). A value of the wrong type, or a config that is not a JSON object, gives no
default (the request keeps the API's).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from types import MappingProxyType
from typing import TypeVar

from metrale.gateway.request_bodies import SamplingFields

SAMPLING_KEYS: Mapping[str, type] = MappingProxyType(
    {
        "temperature": float,
        "top_p": float,
        "top_k": int,
        "min_p": float,
        "repetition_penalty": float,
        "presence_penalty": float,
        "frequency_penalty": float,
    }
)
"""The generation-config keys that default a request field of the same name, and the field's type."""

Body = TypeVar("Body", bound=SamplingFields)


@lru_cache(maxsize=64)
def sampling_defaults(generation_config_json: str) -> Mapping[str, float | int]:
    """The sampling defaults ``generation_config_json`` (a ``generation_config.json`` text) gives."""
    try:
        config = json.loads(generation_config_json)
    except ValueError:
        return MappingProxyType({})
    if not isinstance(config, dict):
        return MappingProxyType({})
    defaults: dict[str, float | int] = {}
    for key, kind in SAMPLING_KEYS.items():
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if kind is int and not (isinstance(value, int) or value.is_integer()):
            continue
        defaults[key] = kind(value)
    return MappingProxyType(defaults)


def with_sampling_defaults(body: Body, defaults: Mapping[str, float | int]) -> Body:
    """``body`` with each field in ``defaults`` that the request did not set taking its default."""
    update = {name: value for name, value in defaults.items() if name not in body.model_fields_set}
    return body.model_copy(update=update) if update else body
