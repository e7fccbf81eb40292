"""SGLang's GPU (L1) and host (L2) prefix caches over trace blocks: one radix tree, two pools.

Follows SGLang 0.5.23's HiCache tree (``mem_cache/unified_cache/unified_tree_core.py``
and ``mem_cache/radix_cache.py``), with a block of the trace as the unit of a key:
- nodes hold runs of blocks; a match or an insert that ends inside a node
  splits it (``_split_node``), and a node's blocks are freed together;
- every node a match or insert walks gets a fresh access counter
  (``_touch_node``: ``get_and_increase_time_counter``), so deeper is newer;
  a split stamps the lower fragment too, just before the path (``_split_node``);
- device eviction pops device leaves by least recent access
  (``evict_device_leaf``): a node with a host copy is demoted (its device copy
  freed), an unbacked one is deleted, or under write_back first backed up to
  host (and, once there, to storage);
- host eviction pops host leaves, nodes with no device copy and no children,
  by least recent access (``_evict_host_leaf``), deleting them;
- a request's path is locked against device eviction while it runs
  (``inc_lock_ref``); a prefetch or load anchor is pinned against host
  eviction (``inc_host_lock_ref``); each lock guards only its own pool;
- under write_back, host pressure first drops host copies of device-resident
  nodes (``_reclaim_full_host_duplicates``);
- write_through backs a new leaf up at once (``write_through_threshold`` 1),
  write_through_selective once an insert walked it twice (threshold 2,
  ``_inc_hit_count_and_check``), write_back never at insert.
Each host backup is reported to ``on_backup`` (SGLang's ``write_backup_storage``
after the host copy: that is when L3 receives pages).
"""
from __future__ import annotations

import heapq
from typing import Callable, List, Optional, Sequence, Tuple

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


class Node:
    """A run of blocks with its state in each pool."""

    __slots__ = ("blocks", "tokens", "children", "parent", "device", "host", "lock", "host_lock", "last_access",
                 "hit_count", "id", "device_children")

    def __init__(self, blocks: List[int], tokens: List[int], parent: Optional["Node"], node_id: int):
        self.blocks = blocks
        self.tokens = tokens
        self.children: dict = {}
        self.parent = parent
        self.device = True
        self.host = False
        self.lock = 0  # running requests on this path: no device eviction (inc_lock_ref)
        self.host_lock = 0  # a prefetch or load anchored here: no host eviction (inc_host_lock_ref)
        self.last_access = 0
        self.hit_count = 0
        self.id = node_id
        self.device_children = 0  # children holding a device copy

    @property
    def size(self) -> int:
        """Tokens the node's blocks hold."""
        return sum(self.tokens)


class BlockRadixTree:
    """The engine's two pools; capacities in tokens (page-aligned blocks)."""

    def __init__(self, device_tokens: int, host_tokens: int, write_policy: str = "write_through",
                 on_backup: Optional[Callable[[List[int], Optional[int]], None]] = None):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown SGLang write policy {write_policy!r}; choose one of {', '.join(WRITE_POLICIES)}")
        self.device_capacity = int(device_tokens)
        self.host_capacity = int(host_tokens)
        self.write_policy = write_policy
        self.threshold = 1 if write_policy == "write_through" else 2
        self.on_backup = on_backup
        self._ids = 0
        self._clock = 0
        self.root = self._new([], [], None)
        self.root.host = True
        self.root.lock = 1
        self.device_used = 0
        self.host_used = 0
        self._device_heap: List[Tuple[int, int, Node]] = []
        self._host_heap: List[Tuple[int, int, Node]] = []
        # Nodes on both device and host, in the order SGLang registers them (full_host_duplicates):
        # under write_back, host pressure frees these host copies before any host-only leaf.
        self._duplicates: dict = {}
        self.backup_failures = 0  # host backups refused: no host leaf to evict

    def _new(self, blocks, tokens, parent) -> Node:
        self._ids += 1
        return Node(blocks, tokens, parent, self._ids)

    def _touch(self, node: Node) -> None:
        self._clock += 1
        node.last_access = self._clock
        self._offer(node)

    def _offer(self, node: Node) -> None:
        """Queue node for the eviction heaps it may be a candidate of (checked again when popped)."""
        if node is self.root:
            return
        if node.device:
            if node.device_children == 0:
                heapq.heappush(self._device_heap, (node.last_access, node.id, node))
        elif node.host and not node.children:
            heapq.heappush(self._host_heap, (node.last_access, node.id, node))

    # ------------------------------------------------------------------ match
    def match(self, blocks: Sequence[int]) -> Tuple[List[Node], int]:
        """Walk the longest cached prefix of blocks, touching it; (path nodes, how many are on device).

        The path is device nodes first, then host-only ones (a device node's
        ancestors are on device). A match ending inside a node splits it.
        """
        node, i, path = self.root, 0, []
        self._touch(node)
        while i < len(blocks):
            child = node.children.get(blocks[i])
            if child is None:
                break
            n = _common(child.blocks, blocks, i)
            if n < len(child.blocks):
                child = self._split(child, n)
            self._touch(child)
            path.append(child)
            node, i = child, i + n
        on_device = 0
        while on_device < len(path) and path[on_device].device:
            on_device += 1
        return path, on_device

    def _split(self, child: Node, n: int) -> Node:
        """Cut child after its first n blocks; the new upper node takes the path position."""
        parent = child.parent
        upper = self._new(child.blocks[:n], child.tokens[:n], parent)
        upper.device, upper.host, upper.lock = child.device, child.host, child.lock
        upper.host_lock = child.host_lock
        upper.hit_count, upper.last_access = child.hit_count, child.last_access
        child.blocks, child.tokens = child.blocks[n:], child.tokens[n:]
        child.parent = upper
        upper.children[child.blocks[0]] = child
        upper.device_children = 1 if child.device else 0
        parent.children[upper.blocks[0]] = upper
        self._note_duplicate(upper)
        self._touch(child)  # SGLang stamps the lower fragment at a split (before the path above it)
        return upper

    # ------------------------------------------------------------------ locks
    def lock(self, node: Node) -> None:
        """Pin node and its ancestors (a request's prefix while it runs)."""
        while node is not self.root:
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        """Undo lock(node); nodes become eviction candidates again."""
        while node is not self.root:
            node.lock -= 1
            self._offer(node)
            node = node.parent

    def pin_host(self, node: Node) -> None:
        """Keep node's host copy (SGLang's inc_host_lock_ref: a prefetch or load anchored there)."""
        node.host_lock += 1

    def unpin_host(self, node: Node) -> None:
        """Undo pin_host; the node may be a host eviction candidate again."""
        node.host_lock -= 1
        self._offer(node)

    # --------------------------------------------------------------- eviction
    def evict_device(self, tokens: int) -> int:
        """Free at least tokens of device memory (whole nodes, least recent first); tokens freed."""
        freed = 0
        heap = self._device_heap
        while freed < tokens and heap:
            stamp, _, node = heapq.heappop(heap)
            if (not node.device or node.lock or node.device_children or stamp != node.last_access
                    or node.parent is None):
                continue  # stale entry: touched, locked, no longer a leaf, or gone
            if not node.host and self.write_policy == "write_back":
                self._backup(node)  # to host first; SGLang drops the subtree when the host is full
            freed += node.size
            self.device_used -= node.size
            node.device = False
            parent = node.parent
            parent.device_children -= 1
            if node.host:
                self._offer(node)  # demoted: now a host-only leaf candidate
            else:
                self._drop_subtree(node)  # unbacked: nothing keeps it (nor host-only nodes under it)
            self._offer(parent)
        return freed

    def evict_host(self, tokens: int) -> int:
        """Free at least tokens of host memory, least recent host-only leaves first; tokens freed.

        Under write_back SGLang first drops host copies of nodes also on the
        device (``_reclaim_full_host_duplicates``: first sparing device
        leaves, whose eviction would keep the copy, then not).
        """
        freed = self._reclaim_duplicates(tokens) if self.write_policy == "write_back" else 0
        heap = self._host_heap
        while freed < tokens and heap:
            stamp, _, node = heapq.heappop(heap)
            if (node.device or not node.host or node.children or node.host_lock or stamp != node.last_access
                    or node.parent is None):
                continue
            freed += node.size
            self.host_used -= node.size
            node.host = False
            parent = node.parent
            self._delete(node)
            self._offer(parent)
        return freed

    def _note_duplicate(self, node: Node) -> None:
        """Track node while it is on both device and host (SGLang's _update_duplicate_tracking)."""
        if node is not self.root and node.device and node.host:
            self._duplicates.setdefault(node.id, node)
        else:
            self._duplicates.pop(node.id, None)

    def _reclaim_duplicates(self, tokens: int) -> int:
        """Drop host copies of device-resident nodes, registration order, until tokens are freed."""
        freed = 0
        for spare_device_leaves in (True, False):
            for node_id, node in list(self._duplicates.items()):
                if freed >= tokens:
                    return freed
                if not (node.device and node.host) or node.parent is None:
                    del self._duplicates[node_id]  # stale
                    continue
                if node.host_lock or (spare_device_leaves and node.device_children == 0 and not node.lock):
                    continue
                node.host = False
                self.host_used -= node.size
                freed += node.size
                del self._duplicates[node_id]
        return freed

    def _drop_subtree(self, node: Node) -> None:
        """Delete node and every node under it (those are host-only: node was a device leaf)."""
        stack = list(node.children.values())
        while stack:
            below = stack.pop()
            stack.extend(below.children.values())
            if below.host:
                self.host_used -= below.size
                below.host = False
            below.parent = None
        node.children = {}
        self._delete(node)

    def _delete(self, node: Node) -> None:
        parent = node.parent
        if parent is not None and parent.children.get(node.blocks[0]) is node:
            del parent.children[node.blocks[0]]
        node.parent = None

    def host_room(self, tokens: int) -> bool:
        """Make host room for tokens, evicting host-only leaves; whether it is there now."""
        short = self.host_used + tokens - self.host_capacity
        if short > 0:
            self.evict_host(short)
        return self.host_used + tokens <= self.host_capacity

    def device_room(self, tokens: int) -> bool:
        """Make device room for tokens, evicting device leaves; whether it is there now."""
        short = self.device_used + tokens - self.device_capacity
        if short > 0:
            self.evict_device(short)
        return self.device_used + tokens <= self.device_capacity

    # ---------------------------------------------------------------- backups
    def _backup(self, node: Node) -> bool:
        """Copy node to host (evicting host leaves), then report it for storage; False when no room."""
        if node.host:
            return True
        if not self.host_room(node.size):
            self.backup_failures += 1
            return False
        node.host = True
        self.host_used += node.size
        if self.on_backup is not None:
            parent = node.parent
            self.on_backup(list(node.blocks), parent.blocks[-1] if parent is not None and parent.blocks else None)
        return True

    def _hit(self, node: Node) -> None:
        """An insert walked node: count it and back it up once it reached the policy's threshold."""
        if self.write_policy == "write_back":
            return
        node.hit_count += 1
        if not node.host and node.hit_count >= self.threshold:
            self._backup(node)

    # ------------------------------------------------------------------ loads
    def load_back(self, nodes: Sequence[Node]) -> bool:
        """Bring host-only nodes (a path, top first) to device; False (nothing moved) without room."""
        need = sum(n.size for n in nodes if not n.device)
        if need == 0:
            return True
        if not self.device_room(need):
            return False
        for node in nodes:
            if not node.device:
                node.device = True
                node.parent.device_children += 1
                self.device_used += node.size
                self._offer(node)  # a device leaf candidate now (nodes off the locked chain too)
        node = nodes[-1]  # finish_load_back: the anchor's root path, device and host copies both
        while node is not None and node is not self.root:
            self._note_duplicate(node)
            node = node.parent
        return True

    def insert_host(self, anchor: Node, blocks: List[int], tokens: List[int]) -> Optional[Node]:
        """Prefetched blocks as a host-only child of anchor (host room made first); None when no room."""
        if not blocks:
            return None
        size = sum(tokens)
        self.pin_host(anchor)  # SGLang pins the prefetch anchor
        try:
            if not self.host_room(size):
                return None
        finally:
            self.unpin_host(anchor)
        node = self._new(list(blocks), list(tokens), anchor)
        node.device, node.host = False, True
        node.hit_count = 1  # it came from storage: do not write it back there
        anchor.children[blocks[0]] = node
        self.host_used += size
        self._touch(node)
        return node

    # ----------------------------------------------------------------- insert
    def insert(self, parent: Node, blocks: List[int], tokens: List[int]) -> Node:
        """Computed blocks under parent (on device): device room made first, then backed up by policy.

        What does not fit beside the locked path is not cached (SGLang would
        retract or chunk such a request). Returns the deepest node.
        """
        size = sum(tokens)
        if size == 0:
            return parent
        self.lock(parent)
        try:
            if not self.device_room(size):
                room = max(self.device_capacity - self.device_used, 0)
                kept, total = 0, 0
                while kept < len(tokens) and total + tokens[kept] <= room:
                    total += tokens[kept]
                    kept += 1
                blocks, tokens, size = blocks[:kept], tokens[:kept], total
                if not blocks:
                    return parent
        finally:
            self.unlock(parent)
        node = self._new(list(blocks), list(tokens), parent)
        parent.children[blocks[0]] = node
        parent.device_children += 1
        self.device_used += size
        self._touch(node)
        self._hit(node)
        return node

    def count_walk(self, path: Sequence[Node]) -> None:
        """An insert walked path (SGLang's _finish_insert_walk_node): count each node for write-through."""
        for node in path:
            self._hit(node)


def _common(node_blocks: List[int], blocks: Sequence[int], start: int) -> int:
    """How many of node_blocks equal blocks[start:] from the front."""
    n = 0
    limit = min(len(node_blocks), len(blocks) - start)
    while n < limit and node_blocks[n] == blocks[start + n]:
        n += 1
    return n
