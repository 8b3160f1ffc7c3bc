"""Calibration and scale levers: collecting batches, modelopt's calibration with the amax ties, GPTQ, SmoothQuant/AWQ
smoothing, the block scale search, learned (LSQ) and static scales, W4A8's per-channel scaling."""
