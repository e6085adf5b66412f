"""Unit tests of ``agent``."""
