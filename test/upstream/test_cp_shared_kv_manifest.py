"""CP-shared KV over Mooncake PD: each prefill rank's page manifest, collected on the
decode.

A request is ready only when the manifests of all ``N`` prefill CP ranks cover its
page positions exactly once, each rank claiming only pages it owns; the codec refuses
anything else.
"""

import unittest

from sglang.srt.disaggregation.mooncake.cp_shared_kv.manifest import (
    Manifest,
    ManifestCollector,
    ManifestError,
    decode,
    encode,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

PAGE_BYTES = 100


def _manifest(table, rank, n, positions=None):
    if positions is None:
        positions = [p for p, lp in enumerate(table) if lp % n == rank]
    return Manifest(
        "r", rank, tuple(table), tuple(positions), len(positions) * PAGE_BYTES
    )


class TestManifest(CustomTestCase):
    def test_complete_only_after_every_rank(self):
        n, table = 4, [41, 42, 43, 44, 49, 50, 51]
        collector = ManifestCollector("r", len(table), n, PAGE_BYTES)
        done = [collector.add(decode(encode(_manifest(table, r, n)))) for r in range(n)]
        self.assertEqual(done, [False] * (n - 1) + [True])
        self.assertTrue(collector.complete)

    def test_a_position_twice_or_not_owned_is_refused(self):
        n, table = 2, [4, 5, 6, 7, 8, 9]
        collector = ManifestCollector("r", len(table), n, PAGE_BYTES)
        mine = [p for p, lp in enumerate(table) if lp % n == 0]
        with self.assertRaisesRegex(ManifestError, "twice"):
            collector.add(_manifest(table, 0, n, mine + mine[:1]))
        collector.add(_manifest(table, 0, n))
        theirs = [p for p, lp in enumerate(table) if lp % n == 1]
        with self.assertRaises(ManifestError):
            collector.add(_manifest(table, 1, n, theirs + mine[:1]))
        self.assertFalse(collector.complete)

    def test_codec_refuses_a_malformed_message(self):
        with self.assertRaises(ValueError):
            decode(b"{not json")


if __name__ == "__main__":
    unittest.main()
