"""Fidelity: labels from measured runs, the calibration grid, the dataset and the estimator."""
