"""Unit tests of ``supervisor.cli``."""
