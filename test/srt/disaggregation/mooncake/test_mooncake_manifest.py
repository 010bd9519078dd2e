"""ManifestCollector: a request is complete only when N manifests rebuild positions 0..n-1 exactly."""

import pytest

from sglang_cp_shared_kv.srt.disaggregation.mooncake.manifest import Manifest, ManifestCollector, ManifestError

PAGE_BYTES = 100


def _table(n_pages, n, first_owner=1, base=40):
    """Owner-balanced logical pages: position p is owned by rank (first_owner + p) % n."""
    return [base * n + ((first_owner + p) % n) + n * (p // n) * 3 for p in range(n_pages)]


def _manifest(table, rank, n, positions=None, nbytes=None, rid="r"):
    if positions is None:
        positions = [p for p, lp in enumerate(table) if lp % n == rank]
    nbytes = len(positions) * PAGE_BYTES if nbytes is None else nbytes
    return Manifest(rid, rank, tuple(table), tuple(positions), nbytes)


@pytest.mark.parametrize("n,n_pages", [(1, 5), (2, 7), (4, 10), (4, 3)])
def test_complete_only_after_every_rank(n, n_pages):
    table = _table(n_pages, n)
    col = ManifestCollector("r", n_pages, n, PAGE_BYTES)
    done = [col.add(_manifest(table, r, n)) for r in reversed(range(n))]
    assert done == [False] * (n - 1) + [True]
    assert col.complete and sorted(col.reported_by) == list(range(n))
    assert sum(col.reported_by.values()) == n_pages


def _rejects(col, m, match):
    before = (dict(col.reported_by), None if col.page_table is None else col.page_table.copy())
    with pytest.raises(ManifestError, match=match):
        col.add(m)
    assert before[0] == col.reported_by and (before[1] is None) == (col.page_table is None)
    assert before[1] is None or (before[1] == col.page_table).all()
    assert not col.complete


def test_out_of_range_position():
    table = _table(8, 2)
    col = ManifestCollector("r", 8, 2, PAGE_BYTES)
    pos = [p for p, lp in enumerate(table) if lp % 2 == 0] + [8]
    _rejects(col, _manifest(table, 0, 2, pos), "position 8, out of range")


def test_duplicate_position_in_one_manifest_and_across_ranks():
    table = _table(8, 2)
    col = ManifestCollector("r", 8, 2, PAGE_BYTES)
    pos = [p for p, lp in enumerate(table) if lp % 2 == 0]
    _rejects(col, _manifest(table, 0, 2, pos + pos[:1]), "twice")
    col.add(_manifest(table, 0, 2))
    # rank 1 repeats a position rank 0 already sent: rank 0 owns it
    _rejects(
        col,
        _manifest(table, 1, 2, [p for p, lp in enumerate(table) if lp % 2 == 1] + pos[:1]),
        f"rank 1 claimed position {pos[0]}, whose page {table[pos[0]]} rank 0 owns",
    )


def test_missing_position():
    table = _table(9, 4)
    col = ManifestCollector("r", 9, 4, PAGE_BYTES)
    pos = [p for p, lp in enumerate(table) if lp % 4 == 2]
    _rejects(col, _manifest(table, 2, 4, pos[:-1]), rf"did not report positions \[{pos[-1]}\]")


def test_position_claimed_by_non_owner():
    table = _table(8, 4)
    col = ManifestCollector("r", 8, 4, PAGE_BYTES)
    mine = [p for p, lp in enumerate(table) if lp % 4 == 3]
    foreign = next(p for p, lp in enumerate(table) if lp % 4 == 0)
    _rejects(col, _manifest(table, 3, 4, sorted(mine[1:] + [foreign])), f"claimed position {foreign}.*rank 0 owns")


def test_page_table_disagreement_and_shape():
    table = _table(8, 2)
    col = ManifestCollector("r", 8, 2, PAGE_BYTES)
    col.add(_manifest(table, 0, 2))
    other = list(table)
    other[3], other[5] = other[5], other[3]  # same owners, different pages
    _rejects(col, _manifest(other, 1, 2), "differing at position 3")
    _rejects(col, _manifest(table[:-1], 1, 2), "page table of 7 pages, expected 8")
    fresh = ManifestCollector("r", 3, 2, PAGE_BYTES)
    _rejects(fresh, _manifest([4, 4, 5], 0, 2), "lists a logical page twice")


def test_bytes_rank_and_repeat():
    table = _table(6, 2)
    col = ManifestCollector("r", 6, 2, PAGE_BYTES)
    _rejects(col, _manifest(table, 0, 2, nbytes=3 * PAGE_BYTES + 1), "bytes for 3 pages")
    _rejects(col, _manifest(table, 2, 2), "rank 2 out of range")
    _rejects(col, _manifest(table, 0, 2, rid="other"), "rank 0 sent a manifest for request 'other'")
    col.add(_manifest(table, 0, 2))
    _rejects(col, _manifest(table, 0, 2), "second manifest")


def test_constructor_rejects_bad_arguments():
    with pytest.raises(ValueError, match="n_pages"):
        ManifestCollector("r", -1, 2, PAGE_BYTES)
    with pytest.raises(ValueError, match="cp_size"):
        ManifestCollector("r", 4, 0, PAGE_BYTES)


@pytest.mark.parametrize("sent, decode", [(1, 2), (2, 1), (4, 2)])
def test_pages_routed_for_another_decode_cp_size(sent, decode):
    table = _table(8, 2)
    col = ManifestCollector("r", 8, 2, PAGE_BYTES, dcp_size=decode)
    m = _manifest(table, 0, 2)
    _rejects(col, Manifest(m.request_id, 0, m.page_table, m.positions, m.nbytes, dcp_size=sent),
             f"rank 0 routed for a decode CP size of {sent}, this decode runs {decode}")  # fmt: skip
    routed = [Manifest(x.request_id, r, x.page_table, x.positions, x.nbytes, decode)
              for r, x in ((r, _manifest(table, r, 2)) for r in range(2))]  # fmt: skip
    assert [col.add(x) for x in routed] == [False, True]
