"""Hooks that swap SGLang's MLA/DSA pools, read path and Mooncake sender for the sharded ones."""


def register() -> None:
    pass
