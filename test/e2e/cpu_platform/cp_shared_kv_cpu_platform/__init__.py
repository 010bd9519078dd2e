"""A test-only SGLang platform: plain torch on the CPU (``platform.py``, its table ``STAND_INS``). Never shipped."""


def activate() -> str:
    """The ``sglang.srt.platforms`` entry point: the platform class's qualified name."""
    return "cp_shared_kv_cpu_platform.platform:CpuTestPlatform"


def load_shims() -> None:
    """The ``sglang.srt.plugins`` entry point: installs ``platform.STAND_INS`` in this process."""
    from cp_shared_kv_cpu_platform.platform import install

    install()
