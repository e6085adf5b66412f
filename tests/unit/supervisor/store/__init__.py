"""Unit tests of ``supervisor.store``."""
