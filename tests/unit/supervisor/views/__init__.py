"""Unit tests of ``supervisor.views``."""
