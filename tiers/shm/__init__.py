"""Shared memory between engines and daemons: memfd mappings, the block arena, page copies and page sums.

The lowest layer the data path stands on (pyproject.toml's import-linter layers): the wire's clients, the
daemons, the stores and the engine-side backend all import it, and it imports none of them.
- ``buffers``: mappings of memfds, guarded copies (a vanished source is an error, not a SIGBUS), prefaulting.
- ``arena``: ``BlockArena``, a sealed memfd of fixed blocks with read leases.
- ``page_runs``: a batch's pages as three arrays and the one guarded C call that copies (and hashes) them.
- ``checksums``: page sums, a batch at a time in C.
"""
