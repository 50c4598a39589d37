# The cases live in the conformance kit; this module runs them over the in-tree harnesses.
from kvgroups_conformance.suite.test_state import *  # noqa: F401,F403
