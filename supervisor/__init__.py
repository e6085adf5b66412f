"""Resurgo's head-node side: decides what to do about faults and does it.

The supervisor depends on ``agent`` for the checkpoint format and the wire
protocol; ``agent`` never imports ``supervisor``.
"""
