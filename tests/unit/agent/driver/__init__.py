"""Unit tests of ``agent.driver``."""
