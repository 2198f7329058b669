"""The same workload through the real engine and through the simulator, errors reported."""
