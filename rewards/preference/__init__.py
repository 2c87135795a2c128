"""Learned preference models: PickScore, HPSv2, ImageReward, the LAION aesthetic predictor, CLIP score."""
