"""The CP-shared KV cache's environment variables, read as SGLang reads its own (``envs.X.get()``).

In SGLang they are fields of its ``Envs``; here, of a class of the same shape that imports neither SGLang
nor torch. Unset, or a value that does not parse (with a warning), reads as the default.
"""

from __future__ import annotations

import os
import warnings
from typing import Any


class _EnvField:
    def __init__(self, default: Any):
        self.default = default

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def is_set(self) -> bool:
        return self.name in os.environ

    def get(self) -> Any:
        value = os.environ.get(self.name)
        try:
            return self.default if value is None else self.parse(value)
        except ValueError as e:
            warnings.warn(f'Invalid value for {self.name}: {e}, using default "{self.default}"', stacklevel=2)
            return self.default


class EnvStr(_EnvField):
    parse = staticmethod(str)


class EnvBool(_EnvField):
    @staticmethod
    def parse(value: str) -> bool:
        if value.lower() in ("true", "1", "yes", "y"):
            return True
        if value.lower() in ("false", "0", "no", "n"):
            return False
        raise ValueError(f'"{value}" is not a valid boolean value')


class EnvInt(_EnvField):
    @staticmethod
    def parse(value: str) -> int:
        try:
            return int(value)
        except ValueError:
            raise ValueError(f'"{value}" is not a valid integer value') from None


class EnvFloat(_EnvField):
    @staticmethod
    def parse(value: str) -> float:
        try:
            return float(value)
        except ValueError:
            raise ValueError(f'"{value}" is not a valid float value') from None


class Envs:
    # --enable-cp-shared-kv: how a prefill CP rank reads its peers' pages (auto: copy
    # engines if all CP ranks are on this node, else the CP group's collectives;
    # copy_engine: required; nccl: never copy engines).
    SGLANG_CP_SHARED_KV_TRANSPORT = EnvStr("auto")
    # Full contexts of prefix the view arena holds per rank.
    SGLANG_CP_SHARED_KV_ARENA_CONTEXTS = EnvInt(2)
    # Build each layer's view a layer ahead (1) or in line (0); unset, limits decide.
    SGLANG_CP_SHARED_KV_PREFETCH = EnvBool(False)
    # Seconds a rank waits for a CP peer before the server stops (under the watchdog).
    SGLANG_CP_SHARED_KV_PEER_TIMEOUT = EnvFloat(60.0)
    # Check stored rows, read plans and manifests (syncs the device).
    SGLANG_DEBUG_CP_SHARED_KV = EnvBool(False)


envs = Envs()
