"""Hand-written fakes shared by the tests, one module per real part they stand for.

Each module's docstring names what it fakes and the real part the slower tiers
run instead. Fakes make the fast tests of pure logic possible; they never
replace the real thing in the local and live tiers (docs/testing.md).
"""
