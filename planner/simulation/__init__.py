"""The SimPy discrete-event simulator driving the engine's own scheduler, and its workloads."""
