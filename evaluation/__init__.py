"""Evaluation: scoring problem files, calibration, benchmarks, the reference decode loop and training-free baselines."""
