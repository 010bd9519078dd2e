"""The demo (``scripts/demo.sh``): the plugin's prefill CP path through SGLang's own classes on CPU.

``run``: the command; ``limits``: what it refuses before any rank starts; ``tiny_model``: the DSA layers
it runs over SGLang's pools; ``sglang_parts``: SGLang's configurator, pools and Mooncake connector set up
without a server (also used by the tests).
"""
