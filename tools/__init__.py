"""Development tooling that is not installed with ucm_patch: the tests and ``scripts/``
import it from the checkout (the serving wheel holds only what serving needs)."""
