"""A port pd-extproc was told to listen on is taken: one error, worded with what moves it."""

from __future__ import annotations

__all__ = ["PortInUse"]


class PortInUse(OSError):
    """`address` is taken; `setting` is the config key (or flag) that moves it."""

    def __init__(self, address: str, setting: str) -> None:
        super().__init__(
            f"{address} is already in use (another pd-extproc or Envoy?): stop what holds it, "
            f"or choose another port with {setting}"
        )
        self.address = address
        self.setting = setting
