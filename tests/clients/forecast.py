"""The one tool every client scenario offers, and the one structured answer they ask for.

Both are bounded (enums only) so that a forced call or a constrained answer from the tiny model always
closes within the tests' ``max_tokens``: a free string could run on to the token limit.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

City = Literal["Paris", "Tokyo", "Lima"]
Unit = Literal["celsius", "fahrenheit"]
QUESTION = "What is the weather in Paris? Use the tool."
TOOL_NAME = "get_forecast"
TOOL_DESCRIPTION = "The weather forecast for a city."
MAX_TOKENS = 128
"""Above one forced call of ``get_forecast`` (50 tokens of the built-in tokenizer) and the built-in
model's answers to these prompts (under 60). The scenarios ask for one call at a time
(``parallel_tool_calls`` false): offered more, the tiny model repeats the call up to the limit."""


def forecast_text(city: str, unit: str) -> str:
    """What the tool returns: fixed, so a test can find it again in the conversation."""
    return f"Sunny in {city}, 21 degrees {unit}."


FORECAST_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
"""``get_forecast``'s parameters as a JSON schema, for clients that take one as it is."""

FORECAST_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": TOOL_NAME, "description": TOOL_DESCRIPTION, "parameters": FORECAST_PARAMETERS, "strict": True},
}
"""``get_forecast`` as a strict chat-completions tool."""


class Sky(StrEnum):
    clear = "clear"
    cloudy = "cloudy"
    rain = "rain"


class Weather(BaseModel):
    """The structured answer the scenarios ask for."""

    model_config = ConfigDict(extra="forbid")

    city: City
    sky: Sky
    warm: bool
