"""Scheduling on the host: the scheduler and what it exchanges with the engine core,
the step shapes, and the batch builder that turns a step's schedule into the index
arrays the device consumes.

numpy only; imports nothing of jpaged's device code.
"""
