"""Capacity planner: catalogues, memory and step-time models, and a simulator of the engine's scheduler.

Importing it must not import torch: it runs where no torch is installed.
"""
