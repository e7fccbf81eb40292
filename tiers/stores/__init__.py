"""Page stores: the PageStore interface (base) and the built-in kinds (dram, nvme, remote)."""
