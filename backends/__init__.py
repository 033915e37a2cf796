"""Built-in backends, installed as ``indexcache.backends``; each subpackage exposes ``BACKEND``."""
