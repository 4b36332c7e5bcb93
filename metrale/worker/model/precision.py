"""Which dtype every value of the model lives in, for any weight dtype chosen.

The weight dtype (``--dtype``: ``auto`` = the config's ``dtype``, or the older ``torch_dtype``) is
that of the matmul weights, the embeddings, the norms, the MLA latent cache and the activations
between layers. Whatever it is:

- the KDA recurrent state and the short-conv state are fp32 (``STATE_DTYPE``): they are carried over
  the whole sequence, and rounding them to 8 bits of mantissa every token would compound;
- so are the few parameters that feed them or the routing directly (``FP32_PARAMETERS``: the conv
  taps, the forget gate's ``A_log`` and ``dt_bias``, the router's score-correction bias) — a few
  thousand values per layer; the release stores ``A_log`` and ``dt_bias`` in fp32 itself;
- the short conv, the recurrence, the gated output norm, the router scores and the attention softmax
  compute in fp32; logits are cast to fp32 before sampling.
"""

from __future__ import annotations

from typing import Protocol

import torch

WEIGHT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
AUTO = "auto"
DTYPE_CHOICES = (AUTO, *WEIGHT_DTYPES)
"""What ``--dtype`` accepts."""

STATE_DTYPE = torch.float32
"""The KDA recurrent and short-conv states, whatever the weight dtype."""

FP32_PARAMETERS = frozenset({"conv_weight", "A_log", "dt_bias", "router_bias"})
"""Parameters (by their last name component) kept in fp32 whatever the weight dtype."""

DtypeChoice = str | torch.dtype | None
"""A weight dtype as asked for: a name of ``DTYPE_CHOICES``, a torch dtype, or None (= ``auto``)."""


class HasDtype(Protocol):
    """A family's config: its ``dtype`` field names the checkpoint's weight dtype."""

    @property
    def dtype(self) -> str: ...


class UnsupportedDtypeError(ValueError):
    """A dtype name that Metrale cannot run a model in; the message lists the ones it can."""


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``float32``, ``bfloat16``, ``float16``)."""
    try:
        return WEIGHT_DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise UnsupportedDtypeError(
            f"dtype {name!r} is not supported (use one of {', '.join(DTYPE_CHOICES)})"
        ) from None


def weight_dtype(choice: DtypeChoice, config: HasDtype) -> torch.dtype:
    """The weight dtype ``choice`` means for ``config``: None or ``auto`` take the config's."""
    if isinstance(choice, torch.dtype):
        if choice not in WEIGHT_DTYPES.values():
            raise UnsupportedDtypeError(f"dtype {choice} is not supported (use one of {', '.join(WEIGHT_DTYPES)})")
        return choice
    if choice is None or choice == AUTO:
        try:
            return parse_dtype(config.dtype)
        except UnsupportedDtypeError as exc:
            raise UnsupportedDtypeError(f"config.json: {exc}; choose one with --dtype") from None
    return parse_dtype(choice)


def parameter_dtype(name: str, weights: torch.dtype) -> torch.dtype:
    """The dtype of parameter ``name`` (a dotted module path) in a model with ``weights`` dtype."""
    return torch.float32 if name.rpartition(".")[2] in FP32_PARAMETERS else weights


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")
