"""Step parameters from engine profiles: fits, and which calibration a deployment gets."""
