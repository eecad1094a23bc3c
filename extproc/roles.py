"""The two engine roles of P/D disaggregation; their values are also the config's pool keys."""

from enum import StrEnum

__all__ = ["Role"]


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
