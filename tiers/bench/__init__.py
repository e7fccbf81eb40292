"""``hicache-tiers bench``: this machine's limits, the peers and this project, measured in one run.

Modules without torch or SGLang (the limits, the report) live here; the
engine-side measurements (real host pools, the real backend) live in
hicache_ext/lab/bench.  Figures are series of repetitions keyed by name
(``Figures``); the report turns them into medians, spreads and ratios.
"""
