"""Unit tests of ``supervisor``."""
