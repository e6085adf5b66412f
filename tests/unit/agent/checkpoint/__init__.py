"""Unit tests of ``agent.checkpoint``."""
