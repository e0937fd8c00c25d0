"""What the paper measures inside a model: gating, nonlocality, attention maps and distance, CKA, masking."""

ANALYSIS_IMAGES = 1024
"""Validation images `analyze` measures by default (the paper's nonlocality uses 1,024). Here, not in report.py,
so that the command line reads it without importing torch."""
