"""Checks at load that a run's prompts fit it: every line scorable by its rewards, and a source image on each
prompt exactly when the model edits one or a reward compares with one (:mod:`flowrl.models.image_prompts`). Each refusal
is a ConfigError naming the key, the line, the prompt and what is accepted."""

from __future__ import annotations

import inspect
from typing import Callable, Sequence

from flowrl.errors import ConfigError, shown, shown_message, shown_path
from flowrl.models.image_prompts import FORM, ImageTooLarge, read_image, split_image_prompts
from flowrl.prompts.source import read_prompt_lines


def check_prompts(spec: str, key: str, check: Callable[[str], None]) -> None:
    """Every prompt of ``spec`` passes ``check`` (a scorer's :meth:`~flowrl_rewards.core.port.Scorer.check_prompt`);
    else a ConfigError naming the key, the line and the prompt. A prompt that carries a source image is checked by its
    instruction text (:mod:`flowrl.models.image_prompts`: what rewards receive)."""
    for where, prompt in read_prompt_lines(spec, key):
        try:
            check(split_image_prompts(prompt)[0])
        except ValueError as e:
            raise ConfigError(
                f"{key}={shown_path(spec, 100)}, {where}: {shown(prompt, 80)} cannot be scored: {shown_message(str(e))}"
            ) from None


def check_prompt_images(
    spec: str, key: str, *, edits: bool, family: str, rewards: Sequence = (), most: int | None = 1
) -> None:
    """At load: every prompt of ``spec`` (a prompt file or inline list, as
    :func:`~flowrl.prompts.source.read_prompt_lines`)
    fits the model and rewards (:func:`check_prompt_fits`). ``rewards``: reward terms (a scorer's ``terms``); one with
    ``needs_source_image`` (:attr:`~flowrl_rewards.core.port.Scorer.needs_source_image`) needs image prompts."""
    needing = [r.name for r in rewards if r.needs_source_image]
    for where, prompt in read_prompt_lines(spec, key):
        check_prompt_fits(
            prompt,
            f"{key}={shown_path(spec, 100)}, {where}: {shown(prompt, 80)}",
            edits=edits,
            family=family,
            needing=needing,
            most=most,
        )


def check_prompt_fits(
    prompt: str, at: str, *, edits: bool, family: str, needing: Sequence[str] = (), most: int | None = 1
) -> None:
    """``prompt`` fits: ``edits`` (the model edits a source image) → it carries one that opens (at most ``most``,
    each opening; None: any number), else it carries none; ``needing`` (names of rewards that compare with the source)
    → it carries one. Else a ConfigError that starts with ``at`` (where the prompt came from) and says what is
    accepted."""
    text, paths = split_image_prompts(prompt)
    path = paths[0] if paths else None
    if edits and path is None:
        raise ConfigError(f"{at} has no source image, but model.family={family!r} edits an image; accepted: {FORM}")
    if not edits and path is not None:
        raise ConfigError(
            f"{at} carries a source image, but model.family={family!r} generates from text; "
            "accepted: text prompts (an image-editing family takes image prompts: "
            "model.family=qwen_image_edit)"
        )
    if path is None and needing:
        raise ConfigError(
            f"{at}: reward {needing[0]!r} compares the sample with the prompt's source image, and "
            f"this prompt has none; accepted: {FORM}"
        )
    if edits and most is not None and len(paths) > most:
        if most > 1:  # the adapter's max_images (Qwen-Image-Edit-Plus)
            raise ConfigError(
                f"{at} carries {len(paths)} images, more than model.kwargs.max_images={most} of model.family="
                f"{family!r}; accepted: 1 to {most} image tags (or raise model.kwargs.max_images)"
            )
        raise ConfigError(
            f"{at} carries {len(paths)} images, but model.family={family!r} edits {most} per prompt; accepted: {FORM} "
            "(several images per prompt: model.family=qwen_image_edit_plus)"
        )
    if path is not None and not text.strip():
        raise ConfigError(f"{at}: the instruction is empty; accepted: {FORM}")
    for path in paths:  # every image of the line (Qwen-Image-Edit 2509/2511 take several)
        if not path:
            raise ConfigError(f"{at}: the image path is empty; accepted: {FORM}")
        try:
            read_image(path)
        except (FileNotFoundError, ImageTooLarge) as e:
            raise ConfigError(f"{at}: {e}") from None
        except OSError as e:
            raise ConfigError(f"{at}: cannot open the image {shown_path(path)} ({e})") from None


def check_run_prompts(cfg, reward, eval_reward, model=None) -> None:
    """At load, before the model loads: every line of ``prompts.train`` / ``prompts.eval`` can be scored by its
    rewards (:func:`check_prompts`) and carries a source image exactly when the model edits (the
    adapter's ``takes_source_image``: ``model``'s when given, else ``model.family``'s) or a reward needs one
    (:func:`check_prompt_images`)."""
    from flowrl.models import model_family

    try:
        adapter = type(model) if model is not None else model_family(cfg.model.family).adapter_class()
    except (ValueError, ImportError, AttributeError, TypeError) as e:  # a bad out-of-tree name: its message names it
        raise ConfigError(str(e)) from e
    family = (model.family if model is not None else None) or cfg.model.family
    edits = bool(adapter.takes_source_image)
    most = adapter.source_images
    if most is None and "max_images" in inspect.signature(adapter).parameters:  # the config decides: at load, too
        most = int(
            getattr(model, "max_images", None)
            or (cfg.model.kwargs or {}).get("max_images")
            or inspect.signature(adapter).parameters["max_images"].default
        )
    for key, spec, judge in (
        ("prompts.train", cfg.prompts.train, reward),
        ("prompts.eval", cfg.prompts.eval, eval_reward),
    ):
        if spec:
            check_prompts(spec, key, judge.check_prompt)
            check_prompt_images(spec, key, edits=edits, family=family, rewards=judge.terms, most=most)
