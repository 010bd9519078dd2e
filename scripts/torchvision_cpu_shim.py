"""Let the CUDA-linked torchvision 0.28.0 wheel import on a CPU-only torch.

The only torchvision 0.28.0 wheel links CUDA torch. On a CPU torch its C++
extension fails to load (silently), and then ``torchvision._meta_registrations``
registers fake kernels for ``torchvision::nms`` / ``torchvision::qnms``, which
raises "operator torchvision::nms does not exist". sglang imports torchvision
from ``sglang.srt.server_args`` onwards, so nothing of sglang imports.

This test-environment shim defines the two operator schemas (no kernels:
calling them still fails loudly) right before that module runs, and only when
torch has no CUDA and the operators are missing. It is not part of the
``sglang_cp_shared_kv`` package; CI installs it into the virtualenv with::

    python scripts/torchvision_cpu_shim.py --install

which copies this file into site-packages as ``_cp_shared_kv_torchvision_shim.py``
and adds a ``.pth`` line importing it (cheap: it only registers an import hook).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_TARGET = "torchvision._meta_registrations"
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBRARY = []  # keeps the Library alive: dropping it would unregister the schemas
MODULE_NAME = "_cp_shared_kv_torchvision_shim"


def define_missing_schemas() -> bool:
    """Define the schemas on a CPU torch that lacks them; True when it did."""
    import torch

    if torch.version.cuda is not None or _LIBRARY:
        return False
    missing = [s for s in _SCHEMAS if not hasattr(torch.ops.torchvision, s.split("(", 1)[0])]
    if not missing:
        return False
    lib = torch.library.Library("torchvision", "DEF")
    for schema in missing:
        lib.define(schema)
    _LIBRARY.append(lib)
    return True


class _Loader(importlib.abc.Loader):
    def __init__(self, wrapped: importlib.abc.Loader):
        self._wrapped = wrapped

    def create_module(self, spec):
        return self._wrapped.create_module(spec)

    def exec_module(self, module):
        define_missing_schemas()
        self._wrapped.exec_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install_hook() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def install_into_site_packages() -> str:
    """Copy this module into purelib and add the ``.pth`` line (idempotent)."""
    import os
    import shutil
    import sysconfig

    site = sysconfig.get_paths()["purelib"]
    shutil.copyfile(__file__, os.path.join(site, MODULE_NAME + ".py"))
    with open(os.path.join(site, MODULE_NAME + ".pth"), "w") as f:
        f.write(f"import {MODULE_NAME}; {MODULE_NAME}.install_hook()\n")
    return site


if __name__ == "__main__":
    if sys.argv[1:] != ["--install"]:
        sys.exit("usage: python scripts/torchvision_cpu_shim.py --install")
    print(f"[setup] torchvision CPU shim installed in {install_into_site_packages()}")
