"""A live OpenAI-compatible endpoint: probed, calibrated and verified against the simulator."""
