"""Helpers shared by the test folders (cases, reference checks, markers), imported as
``tests.support.<module>``."""
