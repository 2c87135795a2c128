"""A bounded cache of prompt embeddings: least recently used entries leave first.

An adapter encodes each distinct prompt once (:meth:`flowrl.models.base.FlowModel.encode`) and keeps its
embeddings on the model's device. Over a long run on a large prompt set (PickScore: ~25k prompts, 2.6 MiB
each for SD3.5 at 77 + 256 tokens) an unbounded cache would outgrow the GPU, so the cache holds at most
``max_bytes`` (``model.prompt_cache_mb``; None: unbounded). An entry is a dict of tensors, each with a
leading batch dimension of 1 (``prompt_embeds`` [1, L, D], ``pooled_prompt_embeds`` [1, D], masks [1, L]).

Eviction runs after a batch has been assembled (:meth:`trim`), so a batch larger than the budget is still
served whole; the budget holds between batches.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

Entry = dict[str, torch.Tensor]


def entry_bytes(entry: Entry) -> int:
    """Bytes held by one entry's tensors."""
    return sum(t.numel() * t.element_size() for t in entry.values())


class PromptCache:
    """LRU map prompt key → embeddings, bounded by ``max_bytes`` (None: unbounded).

    ``hits``/``misses`` count lookups since creation (the number of prompts encoded is ``misses``)."""

    def __init__(self, max_bytes: int | None = None):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, Entry] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def get(self, key: Hashable, encode: Callable[[], Entry]) -> Entry:
        """The entry of ``key``, from ``encode()`` on a miss (then kept); marks it most recently used."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            entry = encode()
            self._entries[key] = entry
            self.bytes += entry_bytes(entry)
        else:
            self.hits += 1
            self._entries.move_to_end(key)
        return entry

    def trim(self) -> int:
        """Drop least recently used entries until at most ``max_bytes`` are held; returns how many left."""
        dropped = 0
        if self.max_bytes is None:
            return dropped
        while self.bytes > self.max_bytes and self._entries:
            _, entry = self._entries.popitem(last=False)
            self.bytes -= entry_bytes(entry)
            dropped += 1
        return dropped

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
