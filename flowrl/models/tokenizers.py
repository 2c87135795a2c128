"""Offline word-level tokenizers for tiny and embedded pipelines (no model hub).

A CLIP BPE tokenizer whose every vocabulary word is exactly one token: the vocabulary holds the
special tokens, every character (plain and with ``</w>``), every substring of every word (``word</w>`` at its end);
the merges join any split of a substring, so each word always ends as one token. Built in memory, so two
processes never race on a shared vocab file.
"""

from __future__ import annotations

from typing import Iterable

BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def clip_vocab_and_merges(words: Iterable[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Vocabulary (token → id) and merges for a word-level CLIP BPE over lower-case ``words``.

    Token ids: 0 = BOS, 1 = EOS (also used as pad), then characters, prefixes and words.
    """
    words = sorted({w.lower() for w in words if w})
    tokens: list[str] = [BOS, EOS]
    seen = set(tokens)

    def add(tok: str) -> None:
        if tok not in seen:
            seen.add(tok)
            tokens.append(tok)

    chars = sorted({c for w in words for c in w} | set("abcdefghijklmnopqrstuvwxyz0123456789.,"))
    for c in chars:
        add(c)
        add(c + "</w>")
    # Every substring of every word is a token and every split of a substring is a merge, so
    # whatever order BPE applies merges in (pairs are shared between words), a word always ends as
    # one token. A chain per word is not enough: "and"'s (a, n) would fire inside "triangles".
    merges: list[tuple[str, str]] = []
    merge_seen: set[tuple[str, str]] = set()
    for w in words:
        n = len(w)
        piece = lambda i, j: w[i:j] + ("</w>" if j == n else "")
        for length in range(2, n + 1):
            for i in range(0, n - length + 1):
                j = i + length
                add(piece(i, j))
                for k in range(i + 1, j):
                    pair = (piece(i, k), piece(k, j))
                    if pair not in merge_seen:
                        merge_seen.add(pair)
                        merges.append(pair)
    return {t: i for i, t in enumerate(tokens)}, merges


def build_clip_tokenizer(words: Iterable[str], model_max_length: int = 24):
    """A ``transformers.CLIPTokenizer`` in which each of ``words`` is one token.

    ``model_max_length`` is always set (the default is effectively unbounded). Pad token = EOS.
    """
    from transformers import CLIPTokenizer

    vocab, merges = clip_vocab_and_merges(words)
    tok = CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=EOS,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        model_max_length=model_max_length,
    )
    return tok
