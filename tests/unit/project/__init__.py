"""Tests of the project as a whole: docs, import rules, test tiers, entry points."""
