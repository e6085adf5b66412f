"""Unit tests of ``agent.train``."""
