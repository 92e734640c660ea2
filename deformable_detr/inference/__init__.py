"""Inference: `Detector` (detection on images, with where the model looks), COCO evaluation, pictures."""
