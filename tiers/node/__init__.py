"""A tier daemon: its loop, page transfers, host-pool attach, arenas, guarded copies, demotion."""
