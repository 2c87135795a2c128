"""Heuristic and composite rewards: image statistics, temporal consistency of video, fidelity to a source image, GDRO's
corrected reward."""
