"""Unit tests of ``supervisor.api``."""
