"""sglang-cp-shared-kv: an SGLang 0.5.23 plugin (``--enable-cp-shared-kv``) that shards the MLA + DSA KV
cache of a prefill server over its context-parallel ranks. SGLang loads it through the entry point
``sglang.srt.plugins: cp_shared_kv`` (``sglang_cp_shared_kv.srt.plugin``); importing this package needs
neither torch nor SGLang."""

__version__ = "0.1.0"
