"""hicache-tiers: node daemons that keep SGLang HiCache pages in DRAM, on NVMe and in remote pools."""
__version__ = "0.1.0"
