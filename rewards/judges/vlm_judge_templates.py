"""The questions of :mod:`flowrl_rewards.judges.vlm_judge` and how their answers are read: VQAScore's yes/no question,
flowrl's motion question, UnifiedReward's pointwise image and video prompts (verbatim) with their ``Final Score``
patterns, and the named templates (:data:`TEMPLATES`)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
DEFAULT_QUESTION = 'Does this figure show "{prompt}"? Please answer yes or no.'
"""VQAScore's question template (t2v_metrics, ``default_question_template``), ``{prompt}`` for its ``{}``."""
MOTION_QUESTION = (
    'This video was generated for the prompt "{prompt}". Is its motion smooth, natural and physically plausible, '
    "without flicker, sudden jumps or objects that deform as they move? Please answer yes or no."
)
"""flowrl's yes/no question about a video's motion (VQAScore's form: read by ``score: yes_probability``)."""
UNIFIEDREWARD_IMAGE = (
    "You are given a text caption and a generated image based on that caption. Your task is to evaluate this image "
    "based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with the provided "
    "caption. Consider the accuracy of depicted objects, their relationships, and attributes as described in the "
    "caption.\n2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail "
    "preservation, color accuracy, and overall aesthetic appeal.\nExtract key elements from the provided text "
    "caption, evaluate their presence in the generated image using the format: 'element (type): value' (where "
    "value=0 means not generated, and value=1 means generated), and assign a score from 1 to 5 after 'Final "
    "Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]"
)
"""UnifiedReward's pointwise image-generation prompt, verbatim (CodeGoat24/UnifiedReward,
``inference_qwen/image_generation/qwen_point_score_image_generation.py``; its LLaVA script's is the same after
``<image>\n``): a score from 1 to 5 after ``Final Score:``."""
UNIFIEDREWARD_VIDEO = (
    "Suppose you are an expert in judging and evaluating the quality of AI-generated videos, please watch the frames "
    "of a given video and see the text prompt for generating the video.\nThen give scores from 5 different "
    "dimensions:\n(1) visual quality: the quality of the video in terms of clearness, resolution, brightness, and "
    "color\n(2) temporal consistency, the consistency of objects or humans in video\n(3) dynamic degree, the degree "
    "of dynamic changes\n(4) text-to-video alignment, the alignment between the text prompt and the video content\n"
    "(5) factual consistency, the consistency of the video content with the common-sense and factual knowledge\n\n"
    "For each dimension, output a number from [1,2,3,4], \nin which '1' means 'Bad', '2' means 'Average', '3' "
    "means 'Good', \n'4' means 'Real' or 'Perfect' (the video is like a real video)\nFinally, based on above 5 "
    "dimensions, assign a score from 1 to 10 after 'Final Score:'\nHere is an output example:\nvisual quality: "
    "4\ntemporal consistency: 4\ndynamic degree: 3\ntext-to-video alignment: 1\nfactual consistency: 2\nFinal "
    "Score: 6\n\n**Note: In the example above, scores are placeholders meant only to demonstrate the format. Your "
    "actual evaluation should be based on the quality of the given video.**\nYour task is provided as follows: Text "
    "Prompt: [{prompt}]"
)
"""UnifiedReward's pointwise video-generation prompt, verbatim (``inference_qwen/video_generation/
qwen_point_score_video_generation.py``): a score from 1 to 10 after ``Final Score:``."""
DEFAULT_FPS = 16.0  # the frame rate of the videos scored: Wan 2.1 / 2.2's output rate (divided by frame_stride)
DEFAULT_PATTERN = r"Final Score:\s*([0-9]+(?:\.[0-9]+)?)"
"""UnifiedReward's pointwise answer ends in ``Final Score: <1–5>``."""
UNIFIEDREWARD_PATTERN = r"(?s)Final Score:(?!.*Final Score:)\D*(\d+)"
"""UnifiedReward's own reading of an answer (``text.split('Final Score:')[-1]``, then its first ``\\d+``): the first
run of digits after the last ``Final Score:`` (``Final Score: **4**`` gives 4, ``3.5`` gives 3)."""
PATTERN_MAX_TOKENS = 512  # the default answer length in pattern mode (a short reasoning, then the score)


@dataclass(frozen=True)
class Template:
    """A named question and how its answer is read: ``kind`` ``yes/no`` (read by ``score`` yes_probability, the
    default, or vqascore) or ``pattern`` (its ``pattern``, ``score_range`` and answer length ``max_tokens``)."""

    question: str
    kind: str = "yes/no"
    pattern: str = DEFAULT_PATTERN
    score_range: tuple[float, float] = (1, 5)
    max_tokens: int = PATTERN_MAX_TOKENS


TEMPLATES = {
    "vqascore": Template(DEFAULT_QUESTION),
    "motion": Template(MOTION_QUESTION),
    "unifiedreward": Template(UNIFIEDREWARD_IMAGE, "pattern", UNIFIEDREWARD_PATTERN, (1, 5), 512),
    "unifiedreward_video": Template(UNIFIEDREWARD_VIDEO, "pattern", UNIFIEDREWARD_PATTERN, (1, 10), 1024),
}
"""The named questions (``template``); ``question`` gives any other. UnifiedReward's answer lengths are its scripts'
``max_new_tokens`` (512 for an image, 1024 for a video)."""
