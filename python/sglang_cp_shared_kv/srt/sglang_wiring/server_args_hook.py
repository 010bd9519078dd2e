"""``--enable-cp-shared-kv``: the flag, and where it lives on SGLang's server args.

sglang 0.5.23 has no API that adds a ``ServerArgs`` field, so the flag rides on two AFTER hooks:

- ``ServerArgs.add_cli_args`` adds the argparse option. The launcher loads plugins before it builds its
  parser, so the option shows in ``python -m sglang.launch_server --help`` and is accepted in a
  ``--config`` YAML file (SGLang's config merger reads the parser's store_true actions).
- ``ServerArgs.from_cli_args`` copies the parsed value onto the record as the plain attribute
  ``enable_cp_shared_kv``, in its ``__dict__``, which ``ServerArgs.__reduce__`` carries to spawned
  scheduler processes.

Not covered (documented): ``sglang serve --help`` (it prints help before it loads plugins; the flag itself
works there) and ``Engine(...)`` keyword construction (``ServerArgs(**kwargs)`` rejects unknown fields).
"""

from __future__ import annotations

import argparse
from typing import Any

from sglang_cp_shared_kv.srt.sglang_wiring import startup_checks
from sglang_cp_shared_kv.srt.sglang_wiring.flag import ATTR, FLAG

_HELP = (
    "Shard the MLA latent + DSA indexer KV cache across the prefill context-parallel ranks: "
    "each logical page is stored once, on rank (page %% attn-cp-size), instead of on every CP rank. "
    "On a prefill server: needs --enable-prefill-cp --cp-strategy interleave over N > 1 attention CP ranks and "
    "--disaggregation-mode prefill --disaggregation-transfer-backend mooncake. On a (non-CP) decode server "
    "with --disaggregation-mode decode: expect and check the prefill ranks' page manifests (sglang-cp-shared-kv plugin)."
)


class _FlagAction(argparse._StoreTrueAction):
    """``store_true`` that, when the flag is given, checks that every plugin hook is installed (parsing comes
    first after SGLang applied them); the rejection prints as its line alone (``install_clean_exit``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        startup_checks.install_clean_exit()
        lines = startup_checks.hook_rejections()
        if lines:
            raise startup_checks.CPSharedKVStartupError("\n".join(lines))


def add_flag(_result: None, parser: argparse.ArgumentParser) -> None:
    """AFTER hook on ``ServerArgs.add_cli_args(parser)``."""
    if FLAG in parser._option_string_actions:  # the same parser passed twice
        return
    parser.add_argument(FLAG, dest=ATTR, action=_FlagAction, default=False, help=_HELP)


def copy_flag(server_args: Any, _cls: type, args: argparse.Namespace) -> None:
    """AFTER hook on ``ServerArgs.from_cli_args(cls, args)``: put the parsed value on the record."""
    setattr(server_args, ATTR, bool(getattr(args, ATTR, False)))


HOOKS = [
    ("sglang.srt.server_args.ServerArgs.add_cli_args", add_flag, "after"),
    ("sglang.srt.server_args.ServerArgs.from_cli_args", copy_flag, "after"),
]
