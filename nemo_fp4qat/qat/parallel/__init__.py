"""Parallel layouts: the process groups statistics are reduced over, local/global expert names, pipeline stages'
layer names, the calibration exchange across stages, and the whole model assembled on one rank for export."""
