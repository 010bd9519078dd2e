"""``--enable-cp-shared-kv``: a field of the parallel argument group, checked at
resolution.

Every rejection is one line naming the flag and the fix, all of a configuration's
together.
"""

import argparse
import unittest

from sglang.srt.server_args import ServerArgs, prepare_server_args
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

PREFILL_CP = [
    "--enable-cp-shared-kv",
    "--enable-prefill-cp",
    "--cp-strategy",
    "interleave",
    "--tp-size",
    "8",
    "--attn-cp-size",
    "8",
    "--disaggregation-mode",
    "prefill",
    "--disaggregation-transfer-backend",
    "mooncake",
]


class TestCPSharedKVFlag(CustomTestCase):
    def test_flag_is_a_server_args_field(self):
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        on = parser.parse_args(["--model-path", "m", "--enable-cp-shared-kv"])
        off = parser.parse_args(["--model-path", "m"])
        self.assertTrue(ServerArgs.from_cli_args(on).enable_cp_shared_kv)
        self.assertFalse(ServerArgs.from_cli_args(off).enable_cp_shared_kv)

    def test_rejections_are_one_line_each(self):
        server_args = prepare_server_args(["--model-path", "dummy", *PREFILL_CP])
        with self.assertRaises(ValueError) as ctx:
            server_args.resolve_once()
        lines = str(ctx.exception).split("\n")
        for line in lines:
            self.assertTrue(line.startswith("--enable-cp-shared-kv: "), line)
            self.assertTrue(line.endswith("."), line)
        self.assertTrue(any("--model-path dummy" in line for line in lines), lines)


if __name__ == "__main__":
    unittest.main()
