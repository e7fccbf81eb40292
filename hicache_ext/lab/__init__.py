"""The lab: everything that drives SGLang's real classes without a GPU, apart from the backend.

- ``sglang_pools``, ``sglang_harness``: real host pools on CPU and the controller's page functions
  (tests, demo, benchmarks).
- ``demo``, ``bench``, ``live``: ``hicache-tiers demo``, ``hicache-tiers bench`` and ``replay --live``
  (their commands, ``cli_demo`` and ``cli_bench``, reach the CLI by entry point, so the node side
  never imports this package: import-linter checks it).
"""
