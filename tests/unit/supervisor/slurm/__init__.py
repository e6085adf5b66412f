"""Unit tests of ``supervisor.slurm``."""
