"""Quantization-aware distillation (QAD): the teacher, the KD losses, and the megatron-core (TP/PP) variant."""
