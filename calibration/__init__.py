"""Calibration data: published runs, fitted efficiency knobs (JSON), measured datasets."""
