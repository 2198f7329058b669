"""What the planner plans for: the model catalogue (HF config.json files) and the hardware catalogue."""
