"""Automatic prefix caching: the coordinator's directory of the full KV blocks the verifier keeps after the requests
that computed them are gone, so that a request whose prompt starts with the same tokens starts on them.

A full block is keyed by a chained hash of the tokens of the request's blocks up to and including it (the target's KV
of a block depends on those tokens alone; this server has one model and no adapters). The drafter's MTP KV of a block
depends on one token more (an MTP entry at pair position p pairs the target's hidden state at p with token p + 1), so
each block has a second key, the block's hash chained with the token after it. Both are computed here, once per
block, and travel with the request (`ScheduledRequest.cached_block_hashes`, `VerifyRequest.registered_blocks`).

The directory is the verifier's cache as the coordinator commands it, so scheduling decisions (what a new request
computes, how many blocks are free) never wait for a worker: a block enters it when a request's tokens through it are
verified (never drafts or placeholders), is shared by reference count, becomes evictable when no running request holds
it, and is evicted least recently used first when the scheduler needs its room. Each schedule's commands go to the
verifier in the iteration's message (`SchedulerOutput.cache_commands`), which applies them before running the step.
The drafter keeps its own MTP-KV cache under the second keys (docs/architecture.md, "Prefix caching"). A drafter
that failed may have lost it: blocks registered before then count as missing on the drafter (`drafter_lost`), so a
request sharing them computes them again on the verifier, whose hidden states let the drafter cache them anew.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from specsplit.coordinator.request import PrefixState, Request

HASH_BYTES = 16
_ROOT = b"specsplit.prefix_cache.v1"


def _chain(parent: bytes, token_ids: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=HASH_BYTES).digest()


@dataclass
class CacheCommands:
    """What the verifier applies before an iteration's step, in this order: forget every cached block (`reset`),
    register `registered` blocks (request id, block index, block hash, drafter key), free the finished requests,
    evict `evicted`."""

    reset: bool = False
    registered: list[tuple[str, int, bytes, bytes]] = field(default_factory=list)
    evicted: list[bytes] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.reset or bool(self.registered) or bool(self.evicted)


class PrefixCache:
    """The directory of cached blocks (hash → running requests holding it), its evictable blocks in LRU order, and
    the commands the verifier has yet to apply."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._refs: dict[bytes, int] = {}
        self._drafter_keys: dict[bytes, bytes] = {}  # block hash -> the drafter key it was registered with
        self._drafter_epoch = 0  # `drafter_lost` calls so far
        self._epoch: dict[bytes, int] = {}  # block hash -> the drafter epoch its drafter key was last sent in
        self._evictable: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        # A new directory knows nothing of what the verifier caches (a scheduler made anew beside a verifier that
        # served another): its first iteration has the verifier forget its cache, as a new coordinator's does.
        self._commands = CacheCommands(reset=True)
        self.queries = 0  # prompt tokens of admitted requests (vllm:prefix_cache_queries)
        self.hits = 0  # of them, those that came from the cache (vllm:prefix_cache_hits)

    @property
    def num_blocks(self) -> int:
        """Blocks in the directory: held by running requests or evictable."""
        return len(self._refs)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def take_commands(self) -> CacheCommands:
        commands, self._commands = self._commands, CacheCommands()
        return commands

    # ---- keys ------------------------------------------------------------------------------------
    def _keys(self, request: Request, num_blocks: int) -> PrefixState:
        """The request's block hashes and drafter keys computed through its first `num_blocks` full blocks (a
        drafter key once the token after its block is known)."""
        state, size = request.prefix, self.block_size
        hashes, keys = state.block_hashes, state.drafter_keys
        if len(hashes) >= num_blocks and (len(keys) == len(hashes) or (len(keys) + 1) * size >= request.num_tokens):
            return state
        tokens = request.all_token_ids
        while len(hashes) < num_blocks:
            j = len(hashes)
            hashes.append(_chain(hashes[-1] if hashes else _ROOT, tokens[j * size : (j + 1) * size]))
        while len(keys) < len(hashes) and (len(keys) + 1) * size < len(tokens):
            j = len(keys)
            keys.append(_chain(hashes[j], [tokens[(j + 1) * size]]))
        return state

    # ---- admission -------------------------------------------------------------------------------
    def lookup(self, request: Request) -> int:
        """How many of the request's leading blocks it starts on: those cached, leaving at least its last token to
        compute (its logits are the step's output), and one fewer where the drafter's entries of the last one paired
        it with another next token (a prompt that goes on differently after a shared prefix): the verifier then
        computes that block again and the drafter gets its hidden states, so the drafter starts on its cached blocks
        too instead of without the prefix."""
        most = (request.num_tokens - 1) // self.block_size
        state = self._keys(request, most)
        hashes = state.block_hashes
        n = 0
        while n < most and hashes[n] in self._refs:
            n += 1
        if n and self._drafter_keys.get(hashes[n - 1]) != state.drafter_keys[n - 1]:
            n -= 1
        held = 0  # the leading blocks the drafter was sent since it last failed: it starts on those alone
        while held < n and self._epoch[hashes[held]] == self._drafter_epoch:
            held += 1
        return held

    def drafter_lost(self) -> None:
        """The drafter failed: the blocks cached so far count as missing from its MTP cache, until a request that
        computes them again sends them to it (`register`)."""
        self._drafter_epoch += 1

    def attach(self, request: Request, num_blocks: int) -> None:
        """The request starts on its first `num_blocks` cached blocks (`lookup`): they are held, not evictable."""
        state = self._keys(request, num_blocks)
        for h in state.block_hashes[:num_blocks]:
            self._refs[h] += 1
            self._evictable.pop(h, None)
        state.held = state.block_hashes[:num_blocks]
        state.num_scanned_blocks = num_blocks

    def count_admission(self, request: Request, num_cached_blocks: int) -> None:
        self.queries += request.num_tokens
        self.hits += num_cached_blocks * self.block_size

    # ---- registration and release ------------------------------------------------------------------
    def register(self, request: Request, num_verified_tokens: int) -> None:
        """The request's full blocks below `num_verified_tokens` (tokens whose KV the verifier computed, never drafts)
        enter the directory, up to its last token (a block's drafter key needs the token after it; a request that
        stopped mid-step computed tokens it dropped). A block whose hash is cached already (another request computed
        the same tokens meanwhile) stays the request's own."""
        num_full = min(num_verified_tokens, request.num_tokens - 1) // self.block_size
        state = request.prefix
        if num_full <= state.num_scanned_blocks:
            return
        self._keys(request, num_full)
        for j in range(state.num_scanned_blocks, num_full):
            h, key = state.block_hashes[j], state.drafter_keys[j]
            if h in self._refs:
                if self._epoch[h] != self._drafter_epoch:  # the drafter lost it: this request's copy goes to it alone
                    self._epoch[h], self._drafter_keys[h] = self._drafter_epoch, key
                    self._commands.registered.append((request.request_id, j, b"", key))
                continue
            self._refs[h] = 1
            self._epoch[h] = self._drafter_epoch
            self._drafter_keys[h] = key
            state.held.append(h)
            self._commands.registered.append((request.request_id, j, h, key))
        state.num_scanned_blocks = num_full

    def release(self, request: Request) -> None:
        """The request's KV is freed: the cached blocks it held stay, evictable once no request holds them (its last
        block first, so a shared prefix outlives the tails)."""
        state = request.prefix
        for h in reversed(state.held):
            refs = self._refs.get(h)
            if refs is None:  # forgotten by a reset meanwhile
                continue
            self._refs[h] = refs - 1
            if refs == 1:
                self._evictable[h] = None
        state.held = []
        state.num_scanned_blocks = 0

    def evict(self, num_blocks: int) -> int:
        """Frees up to `num_blocks` evictable blocks, least recently used first; returns how many."""
        n = min(num_blocks, len(self._evictable))
        for _ in range(n):
            h, _ = self._evictable.popitem(last=False)
            del self._refs[h]
            del self._drafter_keys[h]
            del self._epoch[h]
            self._commands.evicted.append(h)
        return n

    def reset(self) -> None:
        """The verifier's cache is unknown (it failed or restarted): forget every block; the next iteration tells
        the verifier to do the same. Requests' held lists are left to `release` (which skips forgotten hashes)."""
        self._refs.clear()
        self._drafter_keys.clear()
        self._epoch.clear()
        self._evictable.clear()
        self._commands = CacheCommands(reset=True)
