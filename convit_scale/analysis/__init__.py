"""What the paper measures inside a model: gating, nonlocality, attention maps and distance, CKA, masking."""
