"""The in-process backend of :mod:`flowrl_rewards.judges.vlm_judge`: a transformers image-text-to-text judge (Qwen2-VL /
Qwen2.5-VL family, ``AutoModelForImageTextToText`` + ``AutoProcessor``, a hub id or a local folder).

Every image (or video) and its question go through the processor's chat template (a user turn holding the image or
video and the question, after an optional system turn; the generation prompt added), batched with **left** padding so
the last position of every row is its own last prompt token: a score never depends on the rest of the batch.
Images are rounded to 8 bits and go through the image processor's PIL backend (as the other model rewards); a video
[F, 3, H, W] is rounded to 8 bits and goes through the processor's video input (``videos=``, its video processor),
with its frame rate as the video's metadata (Qwen2.5-VL's temporal positions read it).

- yes/no: the next-token distribution after the prompt (softmax over the vocabulary); the score is the mass
  of the "Yes"-like tokens over that of the "Yes"- and "No"-like ones, computed as
  ``sigmoid(logsumexp(logits[yes]) − logsumexp(logits[no]))`` (the same ratio, without underflow);
- VQAScore: the same distribution's probability of the answer token ``Yes`` alone (t2v_metrics' answer template,
  one token), ``exp(logits[Yes] − logsumexp(logits))``, not normalised by "No";
- text: ``generate`` with greedy decoding and ``max_new_tokens``, the new tokens decoded.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from flowrl_rewards.core._common import batches, check_batch_size, resolve_device, resolve_dtype, to_pil, to_uint8

OWNER = "vlm_judge"
YES_WORDS = ("Yes", " Yes", "yes", " yes", "YES", " YES")
NO_WORDS = ("No", " No", "no", " no", "NO", " NO")
ANSWER = "Yes"
"""VQAScore's answer (t2v_metrics, ``default_answer_template``): its score is this token's probability."""


def answer_token_ids(tokenizer: Any, words: Sequence[str]) -> list[int]:
    """Ids of those ``words`` that the tokenizer encodes as one token (each id once, in order)."""
    ids: list[int] = []
    for word in words:
        enc = tokenizer.encode(word, add_special_tokens=False)
        if len(enc) == 1 and enc[0] not in ids:
            ids.append(enc[0])
    return ids


def load_processor(path: str) -> Any:
    """``AutoProcessor`` of ``path`` with a chat template, left padding and the PIL image processor."""
    from transformers import AutoProcessor

    from flowrl_rewards.preference.pickscore import load_image_processor

    try:
        processor = AutoProcessor.from_pretrained(path)
    except Exception as e:
        raise ValueError(
            f"{OWNER}: cannot load a processor from processor={path!r} ({type(e).__name__}: {e}); give "
            "a hub id or a local folder saved with processor.save_pretrained"
        ) from e
    if not getattr(processor, "chat_template", None) or not hasattr(processor, "tokenizer"):
        raise ValueError(
            f"{OWNER}: processor={path!r} has no chat template (or no tokenizer); give the processor "
            "of an instruction-tuned image-text-to-text model, e.g. 'Qwen/Qwen2.5-VL-7B-Instruct'"
        )
    processor.image_processor = load_image_processor(path, OWNER)
    processor.tokenizer.padding_side = "left"
    return processor


def load_model(path: str, dtype: torch.dtype, device: torch.device) -> Any:
    """The ``AutoModelForImageTextToText`` of ``path`` in eval mode, no gradients, on ``device`` in ``dtype``."""
    from transformers import AutoModelForImageTextToText

    try:
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
    except Exception as e:
        raise ValueError(
            f"{OWNER}: cannot load an image-text-to-text model from model={path!r} "
            f"({type(e).__name__}: {e}); give a hub id (e.g. 'Qwen/Qwen2.5-VL-7B-Instruct') or a "
            "local folder saved with model.save_pretrained"
        ) from e
    return model.to(device).eval().requires_grad_(False)


class LocalJudge:
    """A transformers judge: :meth:`yes_probability` and :meth:`answer_probability` (float32 [B]) and
    :meth:`generate` (B answers). ``score`` (the reward's) says which tokens the tokenizer must have as one token:
    the Yes- and No-like ones for ``yes_probability``, ``Yes`` itself for ``vqascore``, none for ``pattern``."""

    def __init__(
        self,
        model: str,
        processor: str,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int = 8,
        score: str = "yes_probability",
    ):
        self.device = resolve_device(device, OWNER)
        self.dtype = resolve_dtype(dtype, self.device, OWNER)
        self.batch_size = check_batch_size(batch_size, OWNER)
        self.processor = load_processor(processor)
        tokenizer = self.processor.tokenizer
        self.yes_ids, self.no_ids = answer_token_ids(tokenizer, YES_WORDS), answer_token_ids(tokenizer, NO_WORDS)
        answer = tokenizer.encode(ANSWER, add_special_tokens=False)
        self.answer_id = answer[0] if len(answer) == 1 else None
        if score == "yes_probability" and (not self.yes_ids or not self.no_ids):
            raise ValueError(
                f"{OWNER}: the tokenizer of processor={processor!r} has no single token for "
                f"{'Yes' if not self.yes_ids else 'No'} (tried {YES_WORDS + NO_WORDS}); "
                "score: yes_probability needs one, use score: pattern"
            )
        if score == "vqascore" and self.answer_id is None:
            raise ValueError(
                f"{OWNER}: the tokenizer of processor={processor!r} encodes {ANSWER!r} as {len(answer)} tokens "
                f"({answer}), not one; score: vqascore is the probability of that one answer token, use score: "
                "yes_probability or pattern"
            )
        self.model = load_model(model, self.dtype, self.device)

    def inputs(
        self, images: torch.Tensor, questions: Sequence[str], systems: Sequence[str | None], fps: float = 0.0
    ) -> Any:
        """The model's inputs for images [b, 3, H, W] or videos [b, F, 3, H, W] in [0, 1] (``fps`` frames per second)
        and their questions, left-padded, on the device."""
        video = images.ndim == 5
        texts = []
        for question, system in zip(questions, systems):
            messages = [{"role": "system", "content": system}] if system else []
            part = {"type": "video" if video else "image"}
            messages.append({"role": "user", "content": [part, {"type": "text", "text": question}]})
            texts.append(self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        if not video:
            batch = self.processor(text=texts, images=to_pil(images), padding=True, return_tensors="pt")
        else:
            batch = self.processor(text=texts, padding=True, return_tensors="pt", **self.video_inputs(images, fps))
        return batch.to(self.device)

    def video_inputs(self, videos: torch.Tensor, fps: float) -> dict:
        """The processor's video keywords for videos [b, F, 3, H, W]: uint8 frames [F, H, W, 3] each, and their frame
        rate (transformers 5: ``video_metadata``; 4: ``fps``). A ValueError when the processor takes no video."""
        if getattr(self.processor, "video_processor", None) is None:
            raise ValueError(
                f"{OWNER}: the processor {type(self.processor).__name__} has no video processor, so it cannot judge "
                f"videos [B, F, 3, H, W] (got {tuple(videos.shape)}); use a video-capable judge's processor, e.g. "
                "'Qwen/Qwen2.5-VL-7B-Instruct'"
            )
        import transformers

        frames = [to_uint8(v) for v in videos]
        if int(transformers.__version__.split(".")[0]) >= 5:
            return {"videos": frames, "video_metadata": [{"fps": fps, "total_num_frames": len(f)} for f in frames]}
        return {"videos": frames, "fps": [fps] * len(frames)}

    @torch.no_grad()
    def first_token_logits(
        self, images: torch.Tensor, questions: Sequence[str], systems: Sequence[str | None], fps: float = 0.0
    ):
        """The next-token logits after each prompt, float32 [b, V], one batch of ``batch_size`` at a time."""
        for sl in batches(images.shape[0], self.batch_size):
            batch = self.inputs(images[sl], questions[sl], systems[sl], fps)
            yield self.model(**batch, logits_to_keep=1).logits[:, -1].float()

    def yes_probability(
        self, images: torch.Tensor, questions: Sequence[str], systems: Sequence[str | None], fps: float = 0.0
    ) -> torch.Tensor:
        """P(yes) / (P(yes) + P(no)) of the first answer token: float32 [B] on the CPU, for images [B, 3, H, W] or
        videos [B, F, 3, H, W] at ``fps``."""
        out = []
        for logits in self.first_token_logits(images, questions, systems, fps):
            yes = torch.logsumexp(logits[:, self.yes_ids], dim=-1)
            no = torch.logsumexp(logits[:, self.no_ids], dim=-1)
            out.append(torch.sigmoid(yes - no).cpu())
        return torch.cat(out) if out else torch.zeros(0)

    def answer_probability(
        self, images: torch.Tensor, questions: Sequence[str], systems: Sequence[str | None], fps: float = 0.0
    ) -> torch.Tensor:
        """VQAScore: P("Yes") of the first answer token, softmax over the whole vocabulary: float32 [B] on the CPU,
        for images [B, 3, H, W] or videos [B, F, 3, H, W] at ``fps``."""
        out = []
        for logits in self.first_token_logits(images, questions, systems, fps):
            out.append((logits[:, self.answer_id] - torch.logsumexp(logits, dim=-1)).exp().cpu())
        return torch.cat(out) if out else torch.zeros(0)

    @torch.no_grad()
    def generate(
        self,
        images: torch.Tensor,
        questions: Sequence[str],
        systems: Sequence[str | None],
        max_new_tokens: int,
        fps: float = 0.0,
    ) -> list[str]:
        """Greedy answers (at most ``max_new_tokens`` tokens each), decoded without special tokens."""
        answers: list[str] = []
        for sl in batches(images.shape[0], self.batch_size):
            batch = self.inputs(images[sl], questions[sl], systems[sl], fps)
            ids = self.model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
            new = ids[:, batch["input_ids"].shape[1] :]
            answers += self.processor.tokenizer.batch_decode(new, skip_special_tokens=True)
        return answers
