"""Unit tests of ``supervisor.act``."""
