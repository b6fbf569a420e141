"""Expert statistics: weight sketches, calibration features, clustering, per-plan statistics."""
