"""Engine-side parts of ``hicache-tiers bench``: real SGLang host pools, the real backend, the peers.

Needs torch and SGLang; the limits and the report are in tiers/bench.
"""
