"""Unit tests of ``agent.node``."""
