"""Prompt sources: which prompt groups each iteration trains on, derived from (seed, iteration).

``PromptSource`` (``prompts.sampling: epoch``) walks seeded permutations; ``AdaptivePromptSource``
(``prompts.sampling: adaptive``) draws prompt *kinds* in proportion to the reward spread their recent
groups showed, so groups that would all score alike (nothing to learn: zero advantage) are drawn less.
"""

from __future__ import annotations

import difflib
import hashlib
import warnings
from pathlib import Path
from typing import Callable

import torch

from flowrl.core.seeding import derive_seed
from flowrl.errors import ConfigError, shown, shown_path
from flowrl.paths import find_file, where_tried


def read_prompts(spec: str, key: str = "prompts.train") -> list[str]:
    """Prompts from a text file (one per line; blank lines and ``#`` comments skipped), resolved
    against the working directory and then the repository root, or inline ``"a|b|c"``."""
    return [prompt for _, prompt in read_prompt_lines(spec, key)]


def read_prompt_lines(spec: str, key: str = "prompts.train") -> list[tuple[str, str]]:
    """``(where, prompt)`` pairs of :func:`read_prompts` (``where``: ``"line 51"`` of a file or ``"prompt 3"``
    of an inline list). ``spec`` is inline when it holds ``|`` or a space and does not look like a path
    (``.txt``, ``/``) or starts with an image prompt (``[image: …]``, :mod:`flowrl.models.image_prompts`); a single
    word is
    a file name, so ``prompts.train=nope`` is an error, not one prompt."""
    looks_like_path = not spec.lstrip().startswith("[image:") and (spec.endswith(".txt") or "/" in spec or "\\" in spec)
    if not looks_like_path and ("|" in spec or " " in spec.strip()):
        pairs = [(f"prompt {i + 1}", p.strip()) for i, p in enumerate(spec.split("|")) if p.strip()]
    else:
        path = find_file(spec)
        if path is None:
            raise FileNotFoundError(
                f"{key}={shown_path(spec)}: no such prompt file (looked in {where_tried(spec)}); inline "
                "prompts are written 'a red circle|two blue squares'"
            )
        try:  # utf-8-sig: a byte-order mark (Windows editors write one) is read as what it is, not as text of line 1
            lines = path.read_text(encoding="utf-8-sig").splitlines()
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"{key}={shown_path(spec)}: not a UTF-8 text file ({e.reason} at byte {e.start})"
            ) from None
        pairs = [
            (f"line {i + 1}", line.strip())
            for i, line in enumerate(lines)
            if line.strip() and not line.lstrip().startswith("#")
        ]
    if not pairs:
        raise ValueError(f"{key}={shown_path(spec)} holds no prompts")
    return pairs


class PromptSource:
    """Epoch-wise shuffled prompts: iteration ``it`` takes prompts ``[it·n, (it+1)·n)`` of an endless
    sequence of seeded permutations, so a resumed run sees exactly the same prompts.

    The loop's contract with a source: :meth:`batch` once per iteration, in order; :meth:`observe`
    after the iteration is scored; :meth:`state_dict` / :meth:`load_state_dict` in checkpoints."""

    def __init__(self, prompts: list[str], per_step: int, seed: int = 0):
        self.prompts = list(prompts)
        self.per_step = per_step
        self.seed = seed

    def _epoch(self, epoch: int) -> list[int]:
        gen = torch.Generator().manual_seed(derive_seed(self.seed, "prompts", epoch))
        return torch.randperm(len(self.prompts), generator=gen).tolist()

    def batch(self, iteration: int) -> list[str]:
        """The ``per_step`` prompts of ``iteration`` (all processes together)."""
        out: list[str] = []
        pos = iteration * self.per_step
        while len(out) < self.per_step:
            epoch, offset = divmod(pos, len(self.prompts))
            out.append(self.prompts[self._epoch(epoch)[offset]])
            pos += 1
        return out

    def observe(self, group_std: torch.Tensor) -> dict[str, float]:
        """Feedback on the last :meth:`batch`: the reward std of each of its groups [per_step] (NaN: not
        scored), gathered over processes. Returns metrics to log. Epochs need no feedback."""
        return {}

    def state_dict(self) -> dict | None:
        """What a checkpoint keeps so that resume draws the same prompts (None: the iteration alone decides)."""
        return None

    def load_state_dict(self, state: dict | None, where: str = "the checkpoint") -> None:
        if state is not None:
            warnings.warn(
                f"{where} holds adaptive prompt statistics but prompts.sampling=epoch: they are not used", stacklevel=2
            )


def shapes_task(prompt: str) -> str:
    """The shapes-world task of ``prompt`` (``single``, ``counting``, ...): a difficulty key."""
    from flowrl.shapes.world import parse

    return parse(prompt).task


DIFFICULTY_KEYS: dict[str, Callable[[str], str]] = {"prompt": lambda p: p, "shapes_task": shapes_task}


def resolve_difficulty_key(name: str) -> Callable[[str], str]:
    """``prompts.difficulty_key``: a name of :data:`DIFFICULTY_KEYS`, or ``package.module:function`` /
    ``path/file.py:function`` mapping a prompt to the key its statistics are pooled under."""
    from flowrl.core.plugins import import_file, import_module, is_file_target

    if name in DIFFICULTY_KEYS:
        return DIFFICULTY_KEYS[name]
    label = f"prompts.difficulty_key={name!r}"
    accepted = f"accepted: {list(DIFFICULTY_KEYS)} or 'package.module:function' / 'path/file.py:function'"
    module_path, _, fn_name = name.rpartition(":")
    if not module_path or not fn_name:
        close = difflib.get_close_matches(name, list(DIFFICULTY_KEYS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{label} is not supported{hint}; {accepted}")
    if is_file_target(module_path):
        if not Path(module_path).expanduser().is_file():
            raise ConfigError(f"{label}: no such file {module_path!r}")
        module = import_file(module_path, "difficulty-key file")
    else:
        try:
            module = import_module(module_path, label)
        except ModuleNotFoundError as e:
            raise ConfigError(str(e)) from e
    fn = getattr(module, fn_name, None)
    if fn is None:
        functions = sorted(
            k for k, v in vars(module).items() if callable(v) and not isinstance(v, type) and not k.startswith("_")
        )
        raise ConfigError(f"{label}: {module_path!r} has no function {fn_name!r} (functions in it: {functions})")
    if not callable(fn):
        raise ConfigError(f"{label} resolves to {fn!r}, which is not callable (prompt -> key)")
    return fn


def check_adaptive_settings(floor: float, decay: float) -> None:
    """``prompts.adaptive_floor`` in (0, 1] and ``prompts.adaptive_decay`` in [0, 1) (checked at config load too)."""
    if not 0.0 < floor <= 1.0:
        raise ConfigError(f"prompts.adaptive_floor={floor} must be in (0, 1]")
    if not 0.0 <= decay < 1.0:
        raise ConfigError(f"prompts.adaptive_decay={decay} must be in [0, 1)")


class AdaptivePromptSource(PromptSource):
    """Difficulty-adaptive prompts. Prompts are pooled by ``key(prompt)`` (the prompt itself, or e.g.
    its task); each iteration draws ``per_step`` keys independently (with replacement) with probability
    ∝ ``max(s_k / mean s, floor)``, where ``s_k`` is an exponential average (``decay``, one update per
    iteration from the mean std of the key's groups in it) of the reward std within the groups of key
    ``k`` (never-seen keys count as average), then takes each key's next prompt from its own seeded
    permutations. :meth:`observe` feeds each iteration's group spreads back; the statistics are part
    of the checkpoint (:meth:`state_dict`), so a resumed run draws the same prompts.

    With about as many keys as draws (``key: prompt`` on a large file) few prompts are seen twice
    and the weights stay near uniform; pool by a coarser key (``shapes_task``) to act within one run.
    """

    def __init__(
        self,
        prompts: list[str],
        per_step: int,
        seed: int = 0,
        key: Callable[[str], str] = lambda p: p,
        floor: float = 0.1,
        decay: float = 0.7,
    ):
        super().__init__(prompts, per_step, seed)
        check_adaptive_settings(floor, decay)
        self.floor, self.decay = floor, decay
        keys = [str(key(p)) for p in self.prompts]
        self.keys = sorted(set(keys))
        index = {k: i for i, k in enumerate(self.keys)}
        self.members = [[] for _ in self.keys]  # prompt indices of each key
        for i, k in enumerate(keys):
            self.members[index[k]].append(i)
        self.key_of_prompt = torch.tensor([index[k] for k in keys])
        self.spread = torch.zeros(len(self.keys), dtype=torch.float64)  # EMA of the group reward std per key
        self.seen = torch.zeros(len(self.keys), dtype=torch.bool)
        self.cursor = torch.zeros(len(self.keys), dtype=torch.long)  # prompts drawn so far per key
        self.fingerprint = _fingerprint(self.prompts, keys)
        self._reset_cache()

    def _reset_cache(self) -> None:
        self._last: list[int] = []
        self._last_iteration: int | None = None
        self._observed = False

    def weights(self) -> torch.Tensor:
        """Draw weight per key [K]: average spread → 1, unseen → 1, spread-less keys → ``floor``."""
        w = torch.ones(len(self.keys), dtype=torch.float64)
        if self.seen.any():
            mean = self.spread[self.seen].mean()
            if mean > 0:
                w[self.seen] = (self.spread[self.seen] / mean).clamp(min=self.floor)
        return w

    def _next_of_key(self, k: int) -> int:
        members = self.members[k]
        epoch, offset = divmod(int(self.cursor[k]), len(members))
        gen = torch.Generator().manual_seed(derive_seed(self.seed, "prompts", "key", self.keys[k], epoch))
        self.cursor[k] += 1
        return members[torch.randperm(len(members), generator=gen)[offset].item()]

    def batch(self, iteration: int) -> list[str]:
        """The ``per_step`` prompts of ``iteration``, drawn from the statistics observed so far (call
        in order: drawing advances each key's position; asking again for the same iteration repeats it)."""
        if iteration == self._last_iteration:
            return [self.prompts[i] for i in self._last]
        gen = torch.Generator().manual_seed(derive_seed(self.seed, "prompts", "adaptive", iteration))
        w = self.weights()
        drawn = torch.multinomial(w, self.per_step, replacement=True, generator=gen).tolist()
        self._last = [self._next_of_key(k) for k in drawn]
        self._last_iteration, self._observed = iteration, False
        return [self.prompts[i] for i in self._last]

    def observe(self, group_std: torch.Tensor) -> dict[str, float]:
        """Fold in the reward std of each group [per_step] of the last :meth:`batch` (NaN: not scored),
        once per batch: each key drawn in it moves its average once, towards its groups' mean std.
        Returns :meth:`stats` after the update."""
        if self._observed:
            raise RuntimeError(f"the spreads of iteration {self._last_iteration} were already observed")
        if len(self._last) != group_std.numel():
            raise ValueError(f"observe got {group_std.numel()} group spreads for {len(self._last)} prompts drawn")
        std = group_std.double()
        ok = ~torch.isnan(std)
        keys = self.key_of_prompt[torch.tensor(self._last, dtype=torch.long)][ok]
        n = torch.zeros(len(self.keys), dtype=torch.float64).index_add_(0, keys, torch.ones_like(std[ok]))
        mean = torch.zeros_like(n).index_add_(0, keys, std[ok]) / n.clamp(min=1)
        new, old = (n > 0) & ~self.seen, (n > 0) & self.seen
        self.spread[new] = mean[new]
        self.spread[old] = self.decay * self.spread[old] + (1 - self.decay) * mean[old]
        self.seen |= n > 0
        self._observed = True
        return self.stats()

    def stats(self) -> dict[str, float]:
        """Each key's draw probability ``prompts/p/<key>`` (up to 16 keys; beyond, only the share of
        keys seen and the largest probability)."""
        w = self.weights()
        p = w / w.sum()
        if len(self.keys) > 16:
            return {"prompts/keys_seen": float(self.seen.double().mean()), "prompts/p_max": float(p.max())}
        return {f"prompts/p/{k}": float(v) for k, v in zip(self.keys, p)}

    def state_dict(self) -> dict:
        return {
            "fingerprint": self.fingerprint,
            "keys": list(self.keys),
            "spread": self.spread.clone(),
            "seen": self.seen.clone(),
            "cursor": self.cursor.clone(),
        }

    def load_state_dict(self, state: dict | None, where: str = "the checkpoint") -> None:
        if state is None:
            raise ValueError(
                f"{where} was written with prompts.sampling=epoch: it holds no prompt statistics for "
                "prompts.sampling=adaptive; resume it with prompts.sampling=epoch, or start a new run"
            )
        if state.get("fingerprint") != self.fingerprint:
            theirs = list(state.get("keys", []))
            raise ValueError(
                f"the checkpoint's prompt statistics were kept for other prompts or keys ({len(theirs)} keys, e.g. "
                f"{theirs[:3]}; now {len(self.keys)}: {self.keys[:3]}): prompts.train or prompts.difficulty_key "
                "changed since it was written; restore them, or start a new run (train.resume=null)"
            )
        self.spread, self.seen, self.cursor = state["spread"].clone(), state["seen"].clone(), state["cursor"].clone()
        self._reset_cache()


def _fingerprint(prompts: list[str], keys: list[str]) -> str:
    """A digest of the prompt list and each prompt's key (what the statistics belong to)."""
    return hashlib.sha1("\n".join(f"{k}\t{p}" for p, k in zip(prompts, keys)).encode()).hexdigest()[:16]


def build_prompt_source(section, seed: int) -> PromptSource:
    """The source ``prompts.sampling`` names, over the ``prompts.train`` prompts; warns (once, here) when they
    are fewer than one iteration draws (``prompts.per_step``): every iteration then trains on repeats."""
    prompts = read_prompts(section.train)
    if len(prompts) < section.per_step:
        warnings.warn(
            f"prompts.train={shown(section.train, 80)} holds {len(prompts)} prompt"
            f"{'s' if len(prompts) != 1 else ''}, fewer than the {section.per_step} prompt groups one "
            f"iteration draws (prompts.per_step={section.per_step}): every iteration repeats prompts; "
            "add prompts or lower prompts.per_step",
            RuntimeWarning,
            stacklevel=2,
        )
    if section.sampling == "epoch":
        return PromptSource(prompts, section.per_step, seed)
    key_fn = resolve_difficulty_key(section.difficulty_key)
    keys = {}
    for p in prompts:
        try:
            keys[p] = str(key_fn(p))
        except Exception as e:  # a prompt the key function cannot read
            raise ConfigError(f"prompts.difficulty_key={section.difficulty_key!r} fails on prompt {p!r}: {e}") from e
    return AdaptivePromptSource(
        prompts,
        section.per_step,
        seed,
        key=keys.__getitem__,
        floor=section.adaptive_floor,
        decay=section.adaptive_decay,
    )
