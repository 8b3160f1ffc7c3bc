"""Layer-wise policies: which layer gets which format (rules and presets), the automatic policy search, and the
layers that deploy fused and so share scales."""
