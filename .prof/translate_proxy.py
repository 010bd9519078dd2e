import time, torch, statistics
import sglang_cp_shared_kv.srt.layers.attention.nsa.materialize_kernels as mk
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize_kernels import translate_locs, PreparedLaunch, _SITES

class K:  # stands in for a compiled kernel: its launcher does nothing
    function = 0; packed_metadata = (4, 1, 0)
    def run(self, *a): pass
mk.triton_enabled = lambda d, u=None: True
mk._no_launch_hooks = lambda: True
mk.current_stream_handle = lambda d: 0
orig_call = PreparedLaunch.__call__
def first(self):
    self._kernel = K()
    mk._COMPILED[self._key] = self._kernel
PreparedLaunch.__init__orig = PreparedLaunch.__init__
page_pos = torch.arange(512, dtype=torch.int64)
locs = torch.arange(4*8192, dtype=torch.int32).view(4, 8192)
# first launch: prime the site with a stub kernel
pl = PreparedLaunch(mk._translate_kernel, (32,), (page_pos, locs, torch.empty_like(locs), 32768, 64, 512), {"BLOCK": 1024})
pl._kernel = K(); mk._COMPILED[pl._key] = pl._kernel
site = (id(mk._translate_kernel), page_pos.device, ("BLOCK", 1024))
_SITES[site] = pl
def t(fn, n=20000):
    for _ in range(1000): fn()
    ts=[]
    for r in range(5):
        t0=time.perf_counter()
        for _ in range(n): fn()
        ts.append((time.perf_counter()-t0)/n*1e6)
    return min(ts)
print("translate_locs", t(lambda: translate_locs(page_pos, locs, 64)))
print("empty_like", t(lambda: torch.empty_like(locs, dtype=None)))
out = torch.empty_like(locs)
print("relaunch", t(lambda: pl.relaunch((32,), (page_pos, locs, torch.empty_like(locs), 32768, 64, 512))))
print("call", t(lambda: pl()))
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize_kernels import LocTranslator
tr = LocTranslator(page_pos, 64)
tr._kernels[(torch.int32, torch.int32)] = K()
mk.current_stream_handle = lambda d: 0
import sglang_cp_shared_kv.srt.layers.attention.nsa.materialize_kernels as m2
print("translator", t(lambda: tr(locs)))
print("torch.empty", t(lambda: torch.empty(locs.shape, dtype=torch.int32, device=page_pos.device)))
