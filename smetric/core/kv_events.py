"""vLLM's KV-event stream decoded into an exact per-engine view of its prefix cache.

The router's own per-engine index (``core/prefix_cache``) only guesses what an engine
holds: it never sees evictions. vLLM started with ``--kv-events-config`` publishes every
block it stores, evicts or clears over ZMQ as multipart ``[topic, seq, payload]``; this
module is the pure part of consuming that stream (no sockets): decoding a payload,
checking the sequence numbers, and applying the events to an index the router can query.

Wire format (``vllm/distributed/kv_events.py``). The payload is a msgpack
``KVEventBatch(ts, events, data_parallel_rank)``; events are msgspec Structs tagged with
``tag=True``, so the tag is the class name (``"BlockStored"``, ``"BlockRemoved"``,
``"AllBlocksCleared"``). Releases differ in two ways, so both are accepted:

- Shape. Older releases declare the structs ``array_like``: a batch is ``[ts, events,
  dp_rank]`` and an event is an array with the tag first. Newer ones encode maps: a batch
  ``{"ts", "events", "data_parallel_rank"}`` and an event ``{"type": tag, ...}``. Mixed
  forms (array batch, map events) occur too.
- Fields. ``BlockStored`` is ``block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys, group_idx, ...`` and ``BlockRemoved`` is
  ``block_hashes, medium, group_idx``; later fields were appended over time and structs
  use ``omit_defaults``, so trailing fields may be missing. Only the fields the index
  needs are read.

Engine block hashes are ``bytes`` (a digest) or ``int`` depending on the release and
``--prefix-caching-hash-algo``; they are kept as given, since they only serve as keys.

Offloaded blocks. vLLM's ``OffloadingConnector`` (CPU offloading) publishes what it copies
to CPU memory as ``BlockStored``/``BlockRemoved`` with ``medium="CPU"`` (``"STORAGE"`` for
a disk tier). By default (``OffloadingConnectorScheduler.take_events``) such a
``BlockStored`` names only block hashes: no tokens, no parent, and the offloaded block
size (0 in the newest releases); each hash is the GPU hash of the last GPU block an
offloaded block covers. The newest releases can instead send full, self-describing events
(``self_describing_kv_events``), which may announce one hash several times. Both are read.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeGuard

import msgspec
import numpy as np

from smetric.core.blocks import chain_hashes

GPU = "GPU"
_TOKEN_LIMIT = 1 << 32
REPLAY_END = -1
DEFAULT_MAX_BLOCKS = 1_000_000
"""Blocks one engine's view holds at most, beyond any real engine's cache (vLLM's GPU
pools hold some 10,000 to 200,000 blocks); a stream naming more is cut, oldest first."""
"""Sequence number of the frame that ends a replay answer (vLLM sends ``-1``, signed)."""

EngineHash = int | bytes


class KVEventError(ValueError):
    """A payload or frame that cannot be read: the stream is corrupt, not merely new."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks the engine cached, in chain order, continuing ``parent_block_hash``."""

    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks the engine evicted; they may sit anywhere in a chain, not only at its end."""

    block_hashes: tuple[EngineHash, ...]
    medium: str | None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole cache (a prefix-cache reset)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published message; ``skipped`` counts events of types this module does not know,
    so that a newer vLLM degrades the view visibly instead of breaking the subscriber.

    ``invalid`` says why each malformed event was left out (a token id outside
    [0, 2**32), hashes that do not match the tokens, a field of the wrong type): one bad
    event costs the view that event, not the batch or the stream.
    """

    timestamp: float
    events: tuple[Event, ...]
    dp_rank: int | None
    skipped: int = 0
    invalid: tuple[str, ...] = ()


_decoder = msgspec.msgpack.Decoder()

# Field order of the array form after the tag, as far as this module reads it (later fields
# such as lora_name and group_idx follow and are ignored).
_ARRAY_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
}


def parse_sequence(frame: bytes) -> int:
    """The batch number of a frame; signed, because a replay ends with ``REPLAY_END``."""
    if len(frame) != 8:
        raise KVEventError(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one payload in either the array or the map form."""
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise KVEventError(f"payload is not valid msgpack: {exc}") from exc
    if isinstance(raw, list) and len(raw) >= 2:
        ts, raw_events = raw[0], raw[1]
        dp_rank = raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict) and "ts" in raw and "events" in raw:
        ts, raw_events = raw["ts"], raw["events"]
        dp_rank = raw.get("data_parallel_rank")
    else:
        raise KVEventError(f"payload is not an event batch: {_preview(raw)}")
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise KVEventError(f"batch timestamp must be a number, got {_preview(ts)}")
    if not isinstance(raw_events, list):
        raise KVEventError(f"batch events must be an array, got {_preview(raw_events)}")
    if dp_rank is not None and not _is_int(dp_rank):
        raise KVEventError(f"batch dp_rank must be an integer, got {_preview(dp_rank)}")
    events: list[Event] = []
    skipped = 0
    invalid: list[str] = []
    for raw_event in raw_events:
        try:
            event = _decode_event(raw_event)
        except KVEventError as exc:
            invalid.append(str(exc))
            continue
        if event is None:
            skipped += 1
        else:
            events.append(event)
    return EventBatch(float(ts), tuple(events), dp_rank, skipped, tuple(invalid))


def _decode_event(raw: Any) -> Event | None:
    """One event, or None for a well-formed event of an unknown type."""
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        fields = dict(zip(_ARRAY_FIELDS.get(tag, ()), raw[1:], strict=False))
    elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
        tag, fields = raw["type"], raw
    else:
        raise KVEventError(f"event is neither a tagged array nor a typed map: {_preview(raw)}")
    if tag == "BlockStored":
        block_size = fields.get("block_size")
        tokens = fields.get("token_ids")
        if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
            raise KVEventError(f"BlockStored token_ids must be integers: {_preview(tokens)}")
        # Offloading's hash-only events may give 0 (an unknown size); others must not.
        if not (_is_int(block_size) and block_size >= (1 if tokens else 0)):
            raise KVEventError(f"BlockStored block_size must be positive, got {block_size!r}")
        # Token ids are hashed as uint32, as the router hashes prompts.
        if tokens and not (min(tokens) >= 0 and max(tokens) < _TOKEN_LIMIT):
            raise KVEventError(f"BlockStored token ids must lie in [0, 2**32): {_preview(tokens)}")
        hashes = _engine_hashes(fields.get("block_hashes"))
        if tokens and len(tokens) // block_size != len(hashes):
            raise KVEventError(
                f"BlockStored has {len(hashes)} hashes but {len(tokens)} tokens of block "
                f"size {block_size}"
            )
        parent = fields.get("parent_block_hash")
        return BlockStored(
            hashes,
            None if parent is None else _engine_hash(parent),
            tuple(tokens),
            block_size,
            _medium(fields.get("medium")),
        )
    if tag == "BlockRemoved":
        return BlockRemoved(
            _engine_hashes(fields.get("block_hashes")), _medium(fields.get("medium"))
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def in_slices(events: Sequence[Event], blocks: int) -> Iterator[list[Event]]:
    """``events`` in order, in slices of at most ``blocks`` blocks each (at least one
    event per slice), a larger event cut in pieces: a ``BlockStored`` piece continues the
    chain of the piece before it, so applying the slices in order is applying the events.
    Whoever applies them can then pause between slices however large an event is."""
    part: list[Event] = []
    size = 0
    for event in events:
        for piece in _pieces(event, blocks):
            count = 0 if isinstance(piece, AllBlocksCleared) else len(piece.block_hashes)
            if part and size + count > blocks:
                yield part
                part, size = [], 0
            part.append(piece)
            size += count
    if part:
        yield part


def _pieces(event: Event, blocks: int) -> Iterator[Event]:
    if isinstance(event, AllBlocksCleared) or len(event.block_hashes) <= blocks:
        yield event
        return
    hashes = event.block_hashes
    if isinstance(event, BlockRemoved):
        for start in range(0, len(hashes), blocks):
            yield BlockRemoved(hashes[start : start + blocks], event.medium)
        return
    tokens, size = event.token_ids, event.block_size
    for start in range(0, len(hashes), blocks):
        yield BlockStored(
            hashes[start : start + blocks],
            event.parent_block_hash if start == 0 else hashes[start - 1],
            tokens[start * size : (start + blocks) * size] if tokens else (),
            size,
            event.medium,
        )


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _engine_hash(value: Any) -> EngineHash:
    if isinstance(value, bytes) or _is_int(value):
        return value
    raise KVEventError(f"block hash must be an integer or bytes, got {_preview(value)}")


def _engine_hashes(value: Any) -> tuple[EngineHash, ...]:
    if not isinstance(value, list):
        raise KVEventError(f"block_hashes must be an array, got {_preview(value)}")
    return tuple(_engine_hash(h) for h in value)


def _medium(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise KVEventError(f"medium must be a string, got {_preview(value)}")


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(slots=True)
class _Tier:
    """The blocks one medium holds, as router keys.

    ``present`` counts engine hashes per router key: two engine hashes can share a key
    (the engine hashes LoRA and multimodal extras the router ignores), and the key stays
    present until the last of them is removed. ``held`` counts the stores of each engine
    hash not yet removed: vLLM announces a hash again for a duplicate GPU block or an
    offloaded chunk that overlaps another, and removes it once per announcement.

    ``stride`` is how many router blocks one engine hash stands for: 1, except for
    vLLM's hash-only offload events with an offloaded block larger than the GPU's, where
    a hash names the last router block of each offloaded block.
    """

    keys: OrderedDict[EngineHash, int] = field(default_factory=OrderedDict)
    held: Counter[EngineHash] = field(default_factory=Counter)
    present: Counter[int] = field(default_factory=Counter)
    stride: int = 1

    def hold(self, engine_hash: EngineHash, key: int) -> bool:
        """Store one announcement; True when the hash is new. ``keys`` stays in the order
        of the latest store, oldest first, for ``drop_oldest``."""
        if engine_hash in self.keys:
            self.held[engine_hash] += 1
            self.keys.move_to_end(engine_hash)
            return False
        self.keys[engine_hash] = key
        self.held[engine_hash] = 1
        self.present[key] += 1
        return True

    def drop(self, engine_hash: EngineHash) -> bool:
        """Remove one announcement; True when the hash is gone."""
        if engine_hash not in self.keys:
            return False
        self.held[engine_hash] -= 1
        if self.held[engine_hash]:
            return False
        del self.held[engine_hash]
        key = self.keys.pop(engine_hash)
        self.present[key] -= 1
        if self.present[key] == 0:
            del self.present[key]
        return True

    def drop_oldest(self) -> None:
        """Forget the hash stored longest ago, however often it was announced (an
        ``OrderedDict``: a plain dict finds its first key in time that grows with the
        keys deleted before it)."""
        oldest = next(iter(self.keys))
        self.held[oldest] = 1
        self.drop(oldest)


class EventIndex:
    """What one engine's cache holds, per medium, kept exact by its KV events.

    vLLM's block hashes cannot be recomputed by the router (they depend on its hash
    algorithm, seed, LoRA and multimodal extras), so each stored block is re-keyed with
    the router's own ``chain_hashes`` over the event's tokens, chained from the router key
    of the event's parent; a request's ``chain_hashes(tokens, block_size)`` then matches
    directly. This only works with the engine's block size: the router must hash prompts
    with it for this view (vLLM's CPU backend uses 32, GPU usually 16), and events with
    another block size are counted in ``mismatched`` and not applied.

    Because a router key names a whole prefix, a set of present keys answers ``match``
    exactly as a tree would: the engine's own lookup also stops at the first missing
    block, wherever an eviction left the hole. Media are kept apart (``"GPU"``, which also
    takes events with no medium, and e.g. ``"CPU"`` from offloading) so the GPU view is
    not inflated by blocks that would have to be loaded back. A hash-only offload event
    is keyed by what the index already knows of that engine hash (its GPU store: vLLM
    offloads a block it computed on the GPU, while the GPU still holds it); a hash it
    does not know is counted in ``unresolved``. LoRA adapters and KV-cache groups of
    hybrid models are not told apart.
    """

    __slots__ = (
        "_tiers",
        "block_size",
        "blocks",
        "evicted",
        "max_blocks",
        "mismatched",
        "orphaned",
        "unresolved",
    )

    def __init__(self, block_size: int, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._tiers: dict[str, _Tier] = {}
        self.blocks = 0
        """Engine hashes held, all media together: at most ``max_blocks``."""
        self.evicted = 0
        """Hashes forgotten, oldest first, to stay within ``max_blocks``: the stream named
        more blocks than the cap (a cap below the engine's cache, or a publisher that
        never removes what it stores)."""
        self.mismatched = 0
        """BlockStored events not applied because their block size is not ours."""
        self.orphaned = 0
        """BlockStored events not applied because their parent is unknown (missed events)."""
        self.unresolved = 0
        """Hashes of hash-only (offload) BlockStored events no medium knew, not applied."""

    def apply(self, events: Sequence[Event]) -> None:
        """Apply a batch's events in order."""
        for event in events:
            if isinstance(event, BlockStored):
                self._store(event)
            elif isinstance(event, BlockRemoved):
                self._remove(event)
            else:
                self.clear()

    def clear(self) -> None:
        """Forget everything: the engine cleared its cache, or restarted."""
        self._tiers.clear()
        self.blocks = 0

    def take(self, rebuilt: EventIndex) -> None:
        """Hold what ``rebuilt`` holds (a view replayed from scratch), in place, so that
        whoever reads this index sees the rebuilt view; counters stay this index's."""
        self._tiers = rebuilt._tiers
        self.blocks = rebuilt.blocks

    def match(self, blocks: np.ndarray, medium: str = GPU) -> int:
        """How many leading router keys of ``blocks`` the engine holds on ``medium``."""
        tier = self._tiers.get(medium)
        if tier is None:
            return 0
        present, stride = tier.present, tier.stride
        # Most engines miss at once: answer them without converting the whole prompt.
        if len(blocks) < stride or int(blocks[stride - 1]) not in present:
            return 0
        keys = blocks.tolist()
        count = 0
        for last in range(stride - 1, len(keys), stride):
            if keys[last] not in present:
                break
            count = last + 1
        return count

    def match_offloaded(self, blocks: np.ndarray) -> int:
        """The longest leading run of ``blocks`` one non-GPU medium holds (CPU, storage):
        what the engine could load back rather than recompute."""
        return max((self.match(blocks, m) for m in self._tiers if m != GPU), default=0)

    def size(self, medium: str = GPU) -> int:
        """Distinct router keys held on ``medium``."""
        tier = self._tiers.get(medium)
        return 0 if tier is None else len(tier.present)

    def _store(self, event: BlockStored) -> None:
        if not event.token_ids:
            self._store_hashes(event)
            return
        if event.block_size != self.block_size:
            self.mismatched += 1
            return
        parent: int | None = None
        if event.parent_block_hash is not None:
            parent = self._router_key(event.parent_block_hash, event.medium)
            if parent is None:
                self.orphaned += 1
                return
        keys = chain_hashes(event.token_ids, event.block_size, parent=parent).tolist()
        tier = self._tiers.setdefault(_tier_name(event.medium), _Tier())
        for engine_hash, key in zip(event.block_hashes, keys, strict=True):
            self._hold(tier, engine_hash, key)

    def _store_hashes(self, event: BlockStored) -> None:
        """A hash-only BlockStored (vLLM's offloading): keys come from the other media."""
        size = event.block_size or self.block_size  # 0: unknown, taken as ours
        if size % self.block_size:
            self.mismatched += 1
            return
        tier = self._tiers.setdefault(_tier_name(event.medium), _Tier())
        tier.stride = size // self.block_size
        for engine_hash in event.block_hashes:
            key = self._router_key(engine_hash, event.medium)
            if key is None:
                self.unresolved += 1
            else:
                self._hold(tier, engine_hash, key)

    def _hold(self, tier: _Tier, engine_hash: EngineHash, key: int) -> None:
        if not tier.hold(engine_hash, key):
            return
        self.blocks += 1
        if self.blocks > self.max_blocks:
            # From the largest medium, so that a small tier keeps what it was just given.
            max(self._tiers.values(), key=lambda t: len(t.keys)).drop_oldest()
            self.blocks -= 1
            self.evicted += 1

    def _remove(self, event: BlockRemoved) -> None:
        tier = self._tiers.get(_tier_name(event.medium))
        if tier is None:
            return
        for engine_hash in event.block_hashes:
            self.blocks -= tier.drop(engine_hash)

    def _router_key(self, engine_hash: EngineHash, medium: str | None) -> int | None:
        """The key of an engine hash, looked up in ``medium`` first: an offloaded chain may
        continue a prefix that only the GPU holds."""
        own = _tier_name(medium)
        tier = self._tiers.get(own)
        if tier is not None and engine_hash in tier.keys:
            return tier.keys[engine_hash]
        for name, other in self._tiers.items():
            if name != own and engine_hash in other.keys:
                return other.keys[engine_hash]
        return None


def _tier_name(medium: str | None) -> str:
    return GPU if medium is None else medium


@dataclass(frozen=True, slots=True)
class SequenceCheck:
    """What a batch's sequence number says about the stream.

    ``missing`` is the batches to ask the replay endpoint for: after a ``gap`` those
    between the last one seen and this one; after a ``restart`` those the new engine
    process published before this one (its numbering starts again at 0).
    """

    status: Literal["ok", "gap", "restart"]
    missing: range = range(0)


class SequenceTracker:
    """Checks that batches arrive one after another, as vLLM numbers them from 0.

    PUB/SUB drops messages silently when a queue overflows, and a restarted engine starts
    numbering again, so every batch is checked before it is applied. On ``restart`` the
    caller must drop the engine's state (``EventIndex.clear``) before applying the batch.
    """

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: int | None = None

    def feed(self, seq: int) -> SequenceCheck:
        """Record ``seq`` as the latest batch and say how it follows the previous one.

        The first batch is ``ok`` whatever its number: a subscriber that joins late has
        missed history no replay can restore anyway (the engine keeps a bounded buffer).
        """
        if seq < 0:
            raise ValueError(f"sequence numbers are non-negative, got {seq}")
        last, self.last = self.last, seq
        if last is None or seq == last + 1:
            return SequenceCheck("ok")
        if seq > last:
            return SequenceCheck("gap", range(last + 1, seq))
        return SequenceCheck("restart", range(0, seq))
