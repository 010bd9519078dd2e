"""Test and demo helpers: a tiny DSA-shaped model stack and its chunked-prefill driver (``dsa_stack``)."""
