"""Fitting the chat to the device: probing devices, the memory model, the planner and the check that runs a plan."""
