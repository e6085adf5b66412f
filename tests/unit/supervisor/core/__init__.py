"""Unit tests of ``supervisor.core``."""
