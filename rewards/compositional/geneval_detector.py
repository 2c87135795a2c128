"""GenEval's two models, as transformers and open_clip provide them: a Mask2Former COCO instance-segmentation
detector (:class:`Mask2FormerDetector`) and a CLIP zero-shot colour classifier (:class:`ClipColors`).

**Detector.** GenEval runs mmdetection's Mask2Former, Swin-S backbone, COCO instance segmentation
(``mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco``). The transformers checkpoint of the same architecture and
training set is ``facebook/mask2former-swin-small-coco-instance`` (the default here; Meta's own training, not
mmdetection's reproduction, so its detections are close but not identical). Its outputs become detections as
mmdetection's Mask2Former head makes them: every (query, class) pair scored by the class probability (softmax
over the classes and "no object", the latter dropped), the ``max_per_image`` (100) best pairs kept, each pair's
mask the query's sigmoid mask > 0.5 at the image's size, its score × the mask's mean sigmoid inside the mask, its
box the mask's extent (x1, y1 end-exclusive). GenEval then keeps, per class, scores above its thresholds
(:func:`flowrl_rewards.compositional.geneval_rules.keep`).

**Colours.** GenEval classifies each detected object of a colour clause with CLIP ViT-L/14 (OpenAI weights)
zero-shot over its ten colours: the object's mask pasted on a grey (#999) canvas, cropped to its box, the
model's own transform; the class embedding of colour c the normalised mean of the normalised embeddings of
"a photo of a {c} {object}", "a photo of a {c}-colored {object}" and "a photo of a {c} object"; the colour the
arg-max of the cosine.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from flowrl_rewards.compositional.geneval_prompts import COCO_CLASSES
from flowrl_rewards.compositional.geneval_rules import COLORS, Found

DEFAULT_DETECTOR = "facebook/mask2former-swin-small-coco-instance"
COCO_ALIASES: dict[str, str] = {
    "mouse": "computer mouse",
    "remote": "tv remote",
    "keyboard": "computer keyboard",
    "tvmonitor": "tv",
    "motorbike": "motorcycle",
    "aeroplane": "airplane",
    "sofa": "couch",
    "pottedplant": "potted plant",
    "diningtable": "dining table",
    "hair dryer": "hair drier",
    "donut": "donut",
    "doughnut": "donut",
}
"""Detector label → GenEval's name, where COCO label sets spell a class otherwise."""


def geneval_name(label: str) -> str:
    """The GenEval class name of a detector label (case and ``_``/``-`` folded; aliases of :data:`COCO_ALIASES`)."""
    key = " ".join(str(label).lower().replace("_", " ").replace("-", " ").split())
    return COCO_ALIASES.get(key, key)


def mask_boxes(masks: torch.Tensor) -> torch.Tensor:
    """Boxes (x0, y0, x1, y1), float32 [N, 4], of bool masks [N, H, W]: the extent of each mask, end-exclusive;
    zeros for an empty mask."""
    n = masks.shape[0]
    boxes = torch.zeros(n, 4)
    cols, rows = masks.any(1), masks.any(2)  # [N, W], [N, H]
    has = cols.any(1)
    if has.any():
        w, h = masks.shape[2], masks.shape[1]
        xs, ys = torch.arange(w), torch.arange(h)
        x0 = torch.where(cols, xs, w).min(1).values
        x1 = torch.where(cols, xs, -1).max(1).values + 1
        y0 = torch.where(rows, ys, h).min(1).values
        y1 = torch.where(rows, ys, -1).max(1).values + 1
        boxes[has] = torch.stack([x0, y0, x1, y1], 1).float()[has]
    return boxes


class Mask2FormerDetector:
    """Detections per image (class → :class:`Found` with box, score and mask) from a transformers Mask2Former
    instance-segmentation checkpoint (a hub id or a local folder with its image processor).

    ``__call__(images)``: uint8 [B, H, W, 3] → one dict per image, class name → detections (unsorted; GenEval's
    thresholds come after). Labels that are not GenEval classes are dropped; a checkpoint with none of them is
    refused at load.
    """

    def __init__(
        self,
        path: str = DEFAULT_DETECTOR,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_size: int = 8,
        max_per_image: int = 100,
        owner: str = "geneval",
    ):
        try:
            from transformers import AutoImageProcessor, Mask2FormerForUniversalSegmentation
        except ImportError as e:  # scipy, which transformers' Mask2Former needs
            raise ImportError(
                f"{owner}: the Mask2Former detector needs transformers and scipy: "
                f"pip install 'flowrl-align[geneval]' ({e})"
            ) from e
        try:
            self.model = Mask2FormerForUniversalSegmentation.from_pretrained(path).eval().requires_grad_(False)
            self.processor = AutoImageProcessor.from_pretrained(path)
        except Exception as e:
            raise RuntimeError(
                f"{owner}: cannot load the detector {path!r} ({type(e).__name__}: {e}); detector= takes "
                f"a transformers Mask2Former instance-segmentation checkpoint: a hub id (default "
                f"{DEFAULT_DETECTOR!r}) or a local folder saved with save_pretrained"
            ) from e
        self.model.to(device=device, dtype=dtype)
        self.device, self.dtype, self.batch_size, self.max_per_image = (
            torch.device(device),
            dtype,
            batch_size,
            max_per_image,
        )
        labels = self.model.config.id2label
        self.names = [geneval_name(labels[i]) for i in range(len(labels))]
        if not set(self.names) & set(COCO_CLASSES):
            raise ValueError(
                f"{owner}: detector={path!r} detects none of GenEval's classes (its labels: "
                f"{self.names[:8]}…); use a COCO instance-segmentation checkpoint"
            )

    @torch.no_grad()
    def __call__(self, images: np.ndarray) -> list[dict[str, list[Found]]]:
        out: list[dict[str, list[Found]]] = []
        for start in range(0, len(images), self.batch_size):
            chunk = images[start : start + self.batch_size]
            inputs = self.processor(images=list(chunk), return_tensors="pt")
            pixels = inputs["pixel_values"].to(self.device, self.dtype)
            mask = inputs.get("pixel_mask")
            result = self.model(pixel_values=pixels, pixel_mask=None if mask is None else mask.to(self.device))
            for i, image in enumerate(chunk):
                valid = None if mask is None else mask[i]
                out.append(
                    self._detections(
                        result.class_queries_logits[i].float(),
                        result.masks_queries_logits[i].float(),
                        valid,
                        image.shape[:2],
                    )
                )
        return out

    def _detections(
        self, class_logits: torch.Tensor, mask_logits: torch.Tensor, valid: torch.Tensor | None, size: tuple[int, int]
    ) -> dict[str, list[Found]]:
        """Detections of one image from class logits [Q, C+1] and mask logits [Q, h, w] (``valid``: the processor's
        pixel mask [H', W'] of the padded input; ``size``: the image's (H, W))."""
        probs = class_logits.softmax(-1)[:, :-1]  # [Q, C]
        n_classes = probs.shape[1]
        k = min(self.max_per_image, probs.numel())
        scores, flat = probs.flatten().topk(k)
        queries, classes = flat // n_classes, flat % n_classes
        masks = self._masks(mask_logits[queries], valid, size)  # [k, H, W] sigmoid
        binary = masks > 0.5
        mask_scores = (masks * binary).flatten(1).sum(1) / (binary.flatten(1).sum(1) + 1e-6)
        final = (scores * mask_scores).cpu()
        boxes = mask_boxes(binary.cpu())
        out: dict[str, list[Found]] = {}
        for j in range(k):
            name = self.names[int(classes[j])]
            if name in COCO_CLASSES:
                out.setdefault(name, []).append(
                    Found(box=tuple(boxes[j].tolist()), score=float(final[j]), mask=binary[j].cpu().numpy())
                )
        return out

    def _masks(self, logits: torch.Tensor, valid: torch.Tensor | None, size: tuple[int, int]) -> torch.Tensor:
        """Sigmoid masks [k, H, W] at the image's size from mask logits [k, h, w] at a quarter of the padded input:
        up to the padded input, the padding cut off (``valid``), then to ``size``."""
        F = torch.nn.functional
        if valid is not None:
            up = F.interpolate(logits[None], size=tuple(valid.shape), mode="bilinear", align_corners=False)[0]
            rows, cols = valid.any(1).nonzero(), valid.any(0).nonzero()
            up = up[:, : int(rows.max()) + 1, : int(cols.max()) + 1]
        else:
            up = logits
        return F.interpolate(up[None], size=size, mode="bilinear", align_corners=False)[0].sigmoid()


class ClipColors:
    """GenEval's colour of each detected object (module docstring): ``__call__(image, found, cls)`` → a colour of
    :data:`~flowrl_rewards.compositional.geneval_rules.COLORS` per detection, for one image uint8 [H, W, 3]."""

    TEMPLATES: tuple[str, ...] = ("a photo of a {c} {o}", "a photo of a {c}-colored {o}", "a photo of a {c} object")

    def __init__(
        self,
        model: Any,
        preprocess: Any,
        tokenizer: Any,
        device: torch.device,
        dtype: torch.dtype,
        background: str = "#999",
        batch_size: int = 16,
    ):
        self.model, self.preprocess, self.tokenizer = model.to(device=device, dtype=dtype).eval(), preprocess, tokenizer
        self.device, self.dtype, self.background, self.batch_size = device, dtype, background, batch_size
        self._classifiers: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def classifier(self, cls: str) -> torch.Tensor:
        """The zero-shot weights of object class ``cls``: float32 [10, D], one normalised row per colour."""
        if cls not in self._classifiers:
            rows = []
            for c in COLORS:
                tokens = self.tokenizer([t.format(c=c, o=cls) for t in self.TEMPLATES]).to(self.device)
                emb = self.model.encode_text(tokens).float()
                emb = (emb / emb.norm(dim=-1, keepdim=True)).mean(0)
                rows.append(emb / emb.norm())
            self._classifiers[cls] = torch.stack(rows)
        return self._classifiers[cls]

    def crops(self, image: np.ndarray, found: Sequence[Found]) -> torch.Tensor:
        """The model's inputs [N, 3, S, S]: each object's mask pasted on the background colour, cropped to its box."""
        from PIL import Image

        pil = Image.fromarray(image)
        blank = Image.new("RGB", pil.size, color=self.background)
        out = []
        for f in found:
            shown = (
                pil
                if f.mask is None
                else Image.composite(pil, blank, Image.fromarray(np.asarray(f.mask, dtype=np.uint8) * 255))
            )
            out.append(self.preprocess(shown.crop(tuple(f.box))))
        return torch.stack(out)

    @torch.no_grad()
    def __call__(self, image: np.ndarray, found: Sequence[Found], cls: str) -> list[str]:
        if not found:
            return []
        weights = self.classifier(cls)
        pixels = self.crops(image, found)
        picks = []
        for start in range(0, len(found), self.batch_size):
            feats = self.model.encode_image(pixels[start : start + self.batch_size].to(self.device, self.dtype)).float()
            feats = feats / feats.norm(dim=-1, keepdim=True)
            picks += (feats @ weights.T).argmax(1).tolist()
        return [COLORS[i] for i in picks]
