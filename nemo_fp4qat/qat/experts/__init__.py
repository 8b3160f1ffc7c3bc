"""Mixture-of-experts layers: router / expert / shared-expert names and refusals, the experts' shared amax, and
transformers 5's fused expert containers."""
