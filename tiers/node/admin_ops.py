"""A daemon's deletes, clears and evictions: what a tenant may ask of its own namespace, and the operator (an
``_admin`` session) of any namespace or all of them.

Each handler checks its request on the loop thread and returns the store's work, which runs where its route
says (tiers/node/routes.py: in the I/O pool for a store that does I/O: a clear of a million NVMe pages punches
and unlinks for seconds while the loop serves everyone else).  Pages deleted or cleared leave the dirty set at
once, so a write-back never carries them down afterwards.
"""
from __future__ import annotations

from typing import Callable, List, Optional

from tiers.node.dirty import DirtySet
from tiers.node.sessions import ADMIN_NAMESPACE
from tiers.stores.base import PageStore
from tiers.wire import messages as M
from tiers.wire import protocol as P

Work = Callable[[], list]


def target_namespace(everything: bool, target: Optional[str], own: str) -> Optional[str]:
    """The namespace an operation acts on (None: every namespace); another's needs an _admin session."""
    if target is not None:
        target = P.check_namespace(target)
    if (everything or (target is not None and target != own)) and own != ADMIN_NAMESPACE:
        raise P.ProtocolError("bad_request", "acting on other namespaces needs an _admin session")
    return None if everything else (target or own)


class StoreAdmin:
    def __init__(self, store: PageStore, dirty: DirtySet, namespace: Callable[..., str]):
        self.store = store
        self.dirty = dirty
        self._namespace = namespace  # namespace(msg, write=True): the session's, checked for its tenant

    def handle_delete(self, msg: M.Delete, frames) -> Work:
        ns = self._namespace(msg, write=True)
        keys: List[str] = P.check_keys(msg.keys)
        for key in keys:
            self.dirty.pop((ns, key))
        return lambda: [P.reply_ok(msg.id, deleted=self.store.delete([(ns, k) for k in keys]))]

    def handle_clear(self, msg: M.Clear, frames) -> Work:
        namespace = target_namespace(msg.everything, msg.ns, self._namespace(msg, write=True))
        self.dirty.discard_namespace(namespace)
        return lambda: [P.reply_ok(msg.id, cleared=self.store.clear(namespace))]

    def handle_evict(self, msg: M.Evict, frames) -> Work:
        own = self._namespace(msg, write=True)
        if msg.nbytes < 0:
            raise P.ProtocolError("bad_request", "bytes must not be negative")
        namespace = target_namespace(msg.everything, msg.ns, own)
        if own == ADMIN_NAMESPACE and msg.ns is None:
            namespace = None  # the operator evicts across every namespace by default

        def work() -> list:
            pages, freed = self.store.evict(msg.nbytes, namespace)
            return [P.reply_ok(msg.id, evicted_pages=pages, evicted_bytes=freed)]
        return work
