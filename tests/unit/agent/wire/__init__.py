"""Unit tests of ``agent.wire``."""
