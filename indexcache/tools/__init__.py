"""The tools: the ``indexcache`` command and what only it needs (calibration search, the small model, the demo)."""
