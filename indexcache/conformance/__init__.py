"""The conformance suite: cases, comparison rules, runner and report writers."""
