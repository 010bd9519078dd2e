"""The CP-shared KV cache's environment variables, read as SGLang reads its own: ``envs.NAME.get()``.

In SGLang they are fields of ``sglang.srt.environ.Envs``. Here they are fields of the same kinds on a class
of the same shape (this module imports neither SGLang nor torch), so each reader is written once for both:
unset reads as the default; a value that does not parse warns and reads as the default, as in SGLang.
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
    # --enable-cp-shared-kv: how each prefill CP rank reads its peers' pages
    # (auto: copy engines when every CP rank is on this node, else the CP group's
    # collectives; copy_engine: required; nccl: never copy engines).
    SGLANG_CP_SHARED_KV_TRANSPORT = EnvStr("auto")
    # --enable-cp-shared-kv: full contexts of prefix the view arena holds per rank.
    SGLANG_CP_SHARED_KV_ARENA_CONTEXTS = EnvInt(2)
    # --enable-cp-shared-kv: build each layer's view one layer ahead (1) or in line
    # (0); unset, the server's limits decide.
    SGLANG_CP_SHARED_KV_PREFETCH = EnvBool(False)
    # --enable-cp-shared-kv: seconds a rank's device waits for a CP peer before the
    # peer counts as lost and the server stops (well under SGLang's watchdog).
    SGLANG_CP_SHARED_KV_PEER_TIMEOUT = EnvFloat(60.0)
    # --enable-cp-shared-kv: check stored rows, read plans and manifests (syncing).
    SGLANG_DEBUG_CP_SHARED_KV = EnvBool(False)


envs = Envs()
